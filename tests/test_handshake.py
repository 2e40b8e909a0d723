"""Handshakes of peers without the token: they learn nothing about the host, cannot fill
the pending-handshake pool that other listeners need, are rate-limited, and cannot flood
the host's log. Each daemon here is started for its test, because the rate limit
remembers 127.0.0.1 for the daemon's lifetime."""

from __future__ import annotations

import logging
import select
import socket
import time

import pytest
from hosts import WAIT, start_host
from rawguest import Closed, RawGuest

from apir.host import handshake as hs
from apir.protocol import messages as m
from apir.transport import parse_address

E = m.ErrorCode


@pytest.fixture
def host(tmp_path):
    h = start_host(tmp_path, "--handshake-timeout", "60")
    yield h
    h.stop()


def _hello(version: int = m.PROTOCOL_VERSION, token: str = "wrong", op_table: bytes | None = None) -> m.Hello:
    return m.Hello(version, m.op_table_hash() if op_table is None else op_table, token, "test", 0)


def _first_reply(address: str, hello: m.Hello) -> m.Error:
    with RawGuest(address, hello=False) as g:
        reply = g.call(hello)
        assert g.closed_by_host()
    assert isinstance(reply, m.Error), reply
    return reply


def test_the_token_is_checked_before_versions(host):
    """A peer without the token learns neither the protocol version nor the op table."""
    for hello in (_hello(version=99), _hello(op_table=b"\0" * 32), _hello(version=99, token="")):
        reply = _first_reply(host.tcp, hello)
        assert reply.code == E.AUTH and "authentication failed" in reply.message
        assert str(m.PROTOCOL_VERSION) not in reply.message and "op table" not in reply.message
    token = open(host.token_file).read().strip()
    reply = _first_reply(host.tcp, _hello(version=99, token=token))  # with it, the usual help
    assert reply.code == E.VERSION and f"this host speaks version {m.PROTOCOL_VERSION}" in reply.message
    reply = _first_reply(host.unix, _hello(version=99, token=""))  # the 0600 socket needs none
    assert reply.code == E.VERSION


def test_a_tcp_flood_leaves_the_unix_socket_served(host):
    flood = [socket.create_connection(parse_address(host.tcp).sockaddr) for _ in range(300)]
    try:
        closed, deadline = 0, time.monotonic() + WAIT  # a guard against a hang, not a speed test
        waiting = list(flood)
        while closed < 300 - hs.MAX_PENDING_PEER and time.monotonic() < deadline:
            ready, _, _ = select.select(waiting, [], [], 0.5)
            for s in ready:  # closed at once, with an Error once the peer's budget is spent
                waiting.remove(s)
                closed += 1
                data = s.recv(4096)
                assert not data or m.decode_header(data[: m.HEADER.size]).opcode == m.OPCODE_OF[m.Error]
        assert closed == 300 - hs.MAX_PENDING_PEER  # only one peer's share stays pending
        with RawGuest(host.unix) as g:  # the flood's pending handshakes do not starve unix
            assert g.welcome.session >= 1
    finally:
        for s in flood:
            s.close()


def test_a_dawdling_handshake_is_dropped_at_the_handshake_timeout(tmp_path):
    """Half a Hello, then nothing: the daemon closes the connection once its
    --handshake-timeout has passed, and says why in its log."""
    h = start_host(tmp_path, "--handshake-timeout", "1")
    try:
        t0 = time.monotonic()
        with RawGuest(h.unix, hello=False) as slow:
            slow.send_raw(m.encode(_hello(token=""))[:20])
            assert slow.closed_by_host()
        assert time.monotonic() - t0 >= 1  # not before it
        assert "dropped unix:local: no handshake within 1s" in h.log.read_text()
    finally:
        h.stop()


def test_failed_handshakes_are_rate_limited_and_logged_at_a_bounded_rate(host):
    t0 = time.monotonic()
    auth = refused = 0
    for _ in range(200):
        with RawGuest(host.tcp, hello=False) as g:
            ready, _, _ = select.select([g.sock], [], [], 0.2)
            try:
                if not ready:
                    g.send(_hello())
                reply = g.recv()
            except (Closed, ConnectionError):  # refused while our Hello was in flight
                refused += 1
                continue
        assert reply.code == E.AUTH, reply
        if "too many failed handshakes" in reply.message:
            refused += 1
        else:
            assert "the token does not match" in reply.message
            auth += 1
    # The budget: FAIL_BURST failures, then one per FAIL_REFILL_S of the time this took.
    assert auth <= hs.FAIL_BURST + (time.monotonic() - t0) / hs.FAIL_REFILL_S + 1
    assert refused >= 100
    with RawGuest(host.unix) as g:  # the unix socket is never rate-limited
        assert g.welcome.session >= 1
    lines = [ln for ln in host.log.read_text().splitlines() if "refused" in ln or "dropped" in ln]
    assert len(lines) < 100, "every refusal was logged"


def test_gate_counts_per_listener_and_per_peer():
    tcp, unix = parse_address("tcp://127.0.0.1:7070"), parse_address("unix:///tmp/x.sock")
    gate = hs.Gate()
    for _ in range(hs.MAX_PENDING_PEER):
        assert gate.admit(tcp, "10.0.0.1", 0.0) is None
    assert "pending from this peer" in gate.admit(tcp, "10.0.0.1", 0.0).message
    assert gate.admit(tcp, "10.0.0.2", 0.0) is None  # another peer has its own share
    for _ in range(hs.MAX_PENDING):
        assert gate.admit(unix, None, 0.0) is None  # the unix listener has its own pool
    assert "already pending on unix://" in gate.admit(unix, None, 0.0).message
    gate.release(unix, None)
    assert gate.admit(unix, None, 0.0) is None
    gate.release(tcp, "10.0.0.1")
    assert gate.admit(tcp, "10.0.0.1", 0.0) is None


def test_gate_failure_budget_refills():
    tcp = parse_address("tcp://127.0.0.1:7070")
    gate = hs.Gate()
    for _ in range(hs.FAIL_BURST):
        gate.failed("10.0.0.1", 0.0)
    assert "too many failed handshakes" in gate.admit(tcp, "10.0.0.1", 0.0).message
    assert gate.admit(tcp, "10.0.0.2", 0.0) is None
    assert gate.admit(tcp, None, 0.0) is None  # unix peers have no budget
    assert gate.admit(tcp, "10.0.0.1", hs.FAIL_REFILL_S) is None  # one more, later
    gate.failed("10.0.0.1", hs.FAIL_REFILL_S)
    assert gate.admit(tcp, "10.0.0.1", hs.FAIL_REFILL_S) is not None
    for i in range(hs.MAX_PEERS + 10):  # the table of peers is bounded
        gate.failed(f"p{i}", 0.0)
    assert len(gate.budget) == hs.MAX_PEERS


def test_peer_keys():
    tcp, vsock = parse_address("tcp://127.0.0.1:7070"), parse_address("vsock://2:7070")
    assert hs.peer_key(tcp, ("10.1.2.3", 5555)) == "10.1.2.3"
    assert hs.peer_key(tcp, ("2001:db8::1:2", 5555, 0, 0)) == hs.peer_key(tcp, ("2001:db8::9", 1, 0, 0))
    assert hs.peer_key(tcp, ("::ffff:10.1.2.3", 5555, 0, 0)) == "10.1.2.3"
    assert hs.peer_key(vsock, (3, 1024)) == "cid 3"
    assert hs.peer_key(parse_address("unix:///tmp/x.sock"), "") is None


def test_refusal_log_is_rate_limited(caplog):
    log = hs.RateLimitedLog(logging.getLogger("apir.test"))
    with caplog.at_level(logging.WARNING, "apir.test"):
        for i in range(1000):
            log.warning(100.0 + i * 0.001, "refused %d", i)
        log.tick(100.0 + hs.LOG_WINDOW_S + 1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[: hs.LOG_BURST] == [f"refused {i}" for i in range(hs.LOG_BURST)]
    assert lines[hs.LOG_BURST:] == [f"{1000 - hs.LOG_BURST} more refused connections not logged in the "
                                    f"last {hs.LOG_WINDOW_S + 1:.0f}s"]
