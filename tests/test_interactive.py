"""`apir run` without -p: the interactive chat, driven through real pipes and signals."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest
from tiny_models import TinyConfig, write_tiny_gguf

import apir as api
from apir.engine import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # seed 4: its greedy reply to "Hi" runs 1506 tokens before an end token (seed 0's: 11,
    # over before a Ctrl-C could reach it)
    return write_tiny_gguf(tmp_path_factory.mktemp("chat") / "tiny.gguf", TinyConfig(context_length=2048),
                           seed=4)


def chat(tiny, *extra: str) -> list[str]:
    return [sys.executable, "-m", "apir.cli", "run", "-m", str(tiny), "--temp", "0", "--backend", "numpy", *extra]


def first_reply(tiny, text: str, n: int) -> str:
    with api.load(str(tiny), backend="numpy") as model:
        ids = model.chat_ids([{"role": "user", "content": text}])
        return "".join(model.stream(ids, SamplingParams(temperature=0, max_tokens=n)))


def test_commands_are_not_messages_and_an_empty_line_goes_on(tiny):
    out = subprocess.run(chat(tiny, "-n", "4"), input="/help\nHi\n\n/clear\nHi\nexit\nHi again\n",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    reply = first_reply(tiny, "Hi", 4)
    # prompts: /help, Hi (answered), the empty line, /clear, Hi (answered as a first turn), exit
    assert out.stdout == f"> > {reply}\n> > > {reply}\n> "
    assert "/clear        forget the conversation" in out.stderr and "(conversation cleared)" in out.stderr
    assert out.stderr.count("generated 4 tokens") == 2  # "Hi again" came after exit


def test_bye_ends_the_chat(tiny):
    out = subprocess.run(chat(tiny, "-n", "2"), input="/bye\nHi\n", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "> " and "generated" not in out.stderr


def read_until(proc: subprocess.Popen, seen: bytearray, pattern: bytes, start: int) -> int:
    """Read the chat's stdout into ``seen`` until ``pattern`` appears at or after ``start``;
    its position."""
    while (at := seen.find(pattern, start)) < 0:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # a guard against a hang, not a timing
        assert ready, f"no {pattern!r} in {bytes(seen)!r}"
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, f"stdout closed before {pattern!r}: {bytes(seen)!r}"
        seen += chunk
    return at


def test_ctrl_c_stops_the_reply_and_a_second_at_the_prompt_quits(tiny):
    """-n -1: the whole reply would be ``full`` tokens long; Ctrl-C cuts it short."""
    with api.load(str(tiny), backend="numpy") as model:
        full = len(list(model.generate_ids(model.chat_ids([{"role": "user", "content": "Hi"}]),
                                           SamplingParams(temperature=0, max_tokens=2048))))
    assert full > 1000
    proc = subprocess.Popen(chat(tiny, "-n", "-1"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        seen = bytearray()
        prompt = read_until(proc, seen, b"> ", 0)
        proc.stdin.write(b"Hi\n")
        proc.stdin.flush()
        read_until(proc, seen, b"", prompt + 3)  # the reply has begun
        proc.send_signal(signal.SIGINT)
        read_until(proc, seen, b"\n> ", prompt + 2)  # back at the prompt
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    stats = [ln for ln in err.decode().splitlines() if "generated" in ln]
    assert len(stats) == 1 and "(stopped)" in stats[0], err.decode()
    generated = int(stats[0].split("generated ")[1].split()[0])
    assert 0 < generated < full
    assert "Traceback" not in err.decode() and "interrupted" not in err.decode()


def test_a_message_past_the_context_is_reported_and_the_chat_goes_on(tiny):
    out = subprocess.run(chat(tiny, "-n", "4", "-c", "64"), input="x" * 200 + "\nHi\n",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "but the context holds 64; shorten it or raise --ctx-size (up to 2048); or /clear to start a new conversation")
    assert out.stdout == f"> > {first_reply(tiny, 'Hi', 4)}\n> "  # the overlong message left no trace
