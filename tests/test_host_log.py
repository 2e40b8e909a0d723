"""What the host and the guest say about a session's ends: a normal exit is logged as an
exit, a TCP guest without a token is told it sent none, and the hint for a host that is
not running says how to start one for TCP."""

from __future__ import annotations

from pathlib import Path

import pytest
from hosts import start_host
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends.remote import AuthError
from apir.engine import SamplingParams
from apir.spawn import free_port
from apir.transport import HostUnreachable

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("log") / "tiny.gguf", TinyConfig()))


def test_guests_that_exit_normally_are_logged_as_exits(tiny, tmp_path, monkeypatch):
    h = start_host(tmp_path)
    monkeypatch.setenv("APIR_TOKEN", open(h.token_file).read().strip())
    try:
        n = 0
        for url in [h.unix] * 12 + [h.tcp] * 8:  # ring sessions and socket sessions
            with apir.load(tiny, backend="remote", remote=url, token=Path(h.token_file).read_text().strip()) as model:
                assert len(list(model.generate_ids([256, 104, 101], GREEDY))) == 4
            n += 1
    finally:
        h.stop()
    log = h.log.read_text()
    assert log.count(" end: peer ") == n, log
    assert "went away" not in log, log


def test_a_tcp_guest_without_a_token_is_told_it_sent_none(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("APIR_TOKEN", raising=False)
    monkeypatch.delenv("APIR_TOKEN_FILE", raising=False)
    h = start_host(tmp_path)
    try:
        with pytest.raises(AuthError, match="no token was sent, and this host requires one"):
            apir.load(tiny, backend="remote", remote=h.tcp)
        wrong = tmp_path / "wrong-token"
        wrong.write_text("not-the-hosts-secret")
        with pytest.raises(AuthError, match="the token does not match"):
            apir.load(tiny, backend="remote", remote=h.tcp, token=wrong.read_text().strip())
    finally:
        h.stop()


def test_the_hint_for_a_tcp_host_says_how_to_start_one_with_a_token(tiny):
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(HostUnreachable, match=f"start one with `apir host --listen {url} --token-file FILE`"):
        apir.load(tiny, backend="remote", remote=url)
