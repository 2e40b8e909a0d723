"""Who may open a session: the Hello check shared by the daemon and a VM's region, and
the daemon's admission of connections that have not finished their handshake.

The token is checked before anything else in the Hello: a peer that does not hold it
learns nothing about this host (not its protocol version, not its op table). Pending
handshakes are counted per listener and per remote peer, so a flood on the TCP port
cannot starve the Unix socket, and a peer whose handshakes keep failing spends a budget
that refills slowly; once it is spent, its connections are closed at accept. Refusals
are logged at a bounded rate.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections import Counter

from ..protocol import PROTOCOL_VERSION, ErrorCode, op_table_hash
from ..protocol import messages as m
from ..transport import Address

HANDSHAKE_MAX = 4096  # bytes a Hello may take
MAX_PENDING = 256  # handshakes pending on one listener; more are closed at once
MAX_PENDING_PEER = 16  # handshakes pending from one remote peer (an IPv4 address, an IPv6 /64, a CID)
FAIL_BURST = 10  # failed handshakes a remote peer may have in a row...
FAIL_REFILL_S = 2.0  # ...then one more every this many seconds
MAX_PEERS = 4096  # remote peers whose failures are remembered (least recent forgotten first)
LOG_BURST = 20  # refusal lines per window; the rest are counted in one line
LOG_WINDOW_S = 10.0


def check_hello(hello: object, token: str | None) -> m.Error | None:
    """Why this first message cannot open a session (None: it can). ``token`` is the secret
    the connection must present, or None where reaching the endpoint is the permission
    (a 0600 Unix socket, a VM's region). The token comes first: until it matches, the
    answer says nothing about this host."""
    if not isinstance(hello, m.Hello):
        return m.Error(ErrorCode.PROTOCOL, f"expected a Hello handshake first, got {type(hello).__name__}")
    if token is not None and not hmac.compare_digest(hello.token.encode(), token.encode()):
        if not hello.token:  # says only what the guest sent, nothing about the host
            return m.Error(ErrorCode.AUTH, "authentication failed: no token was sent, and this "
                           "host requires one (set APIR_TOKEN or --token-file to the host's "
                           "--token-file secret)")
        return m.Error(ErrorCode.AUTH, "authentication failed: the token does not match the host's "
                       "(set APIR_TOKEN or --token-file to the host's --token-file secret)")
    if hello.version != PROTOCOL_VERSION:
        return m.Error(ErrorCode.VERSION,
                       f"protocol version mismatch: the guest speaks version {hello.version}, this host "
                       f"speaks version {PROTOCOL_VERSION}; install the same apir release on both sides")
    if hello.op_table != op_table_hash():
        return m.Error(ErrorCode.VERSION, "op tables differ between guest and host (same protocol version, "
                       "different apir builds); install the same apir release on both sides")
    return None


def peer_key(address: Address, peer: object) -> str | None:
    """Whom per-peer limits count: the IPv4 address, the IPv6 /64 (one host usually holds a
    whole /64), the vsock CID; None on a Unix socket (only its owner can connect)."""
    if address.scheme == "unix" or not isinstance(peer, tuple) or not peer:
        return None
    if address.scheme == "vsock":
        return f"cid {peer[0]}"
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except ValueError:
        return str(peer[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Gate:
    """Admission of new connections. ``admit`` before a connection becomes pending,
    ``release`` when it stops being pending (session, refusal, timeout, hang-up), ``failed``
    when a remote peer's handshake fails (no valid token shown in time)."""

    def __init__(self) -> None:
        self.listeners: Counter[Address] = Counter()
        self.peers: Counter[tuple[Address, str]] = Counter()
        self.budget: dict[str, tuple[float, float]] = {}  # peer -> (failures left, when counted)

    def admit(self, address: Address, key: str | None, now: float) -> m.Error | None:
        """None and the connection is counted as pending, or why it is refused: AUTH for a
        peer whose failure budget is spent, QUOTA for a full pool."""
        if key is not None and self._left(key, now) < 1:
            return m.Error(ErrorCode.AUTH, f"too many failed handshakes from this address; "
                           f"it may try once every {FAIL_REFILL_S:g}s")
        if self.listeners[address] >= MAX_PENDING:
            return m.Error(ErrorCode.QUOTA, f"{MAX_PENDING} handshakes already pending on {address}")
        if key is not None and self.peers[address, key] >= MAX_PENDING_PEER:
            return m.Error(ErrorCode.QUOTA, f"{MAX_PENDING_PEER} handshakes already pending from this peer")
        self.listeners[address] += 1
        if key is not None:
            self.peers[address, key] += 1
        return None

    def release(self, address: Address, key: str | None) -> None:
        _decrement(self.listeners, address)
        if key is not None:
            _decrement(self.peers, (address, key))

    def failed(self, key: str | None, now: float) -> None:
        if key is None:
            return
        left = self._left(key, now) - 1
        self.budget.pop(key, None)  # re-inserted last: the dict is ordered by last failure
        self.budget[key] = (max(left, 0.0), now)
        while len(self.budget) > MAX_PEERS:
            del self.budget[next(iter(self.budget))]

    def _left(self, key: str, now: float) -> float:
        left, then = self.budget.get(key, (FAIL_BURST, now))
        return min(float(FAIL_BURST), left + max(now - then, 0.0) / FAIL_REFILL_S)


def _decrement(counter: Counter, key: object) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


class RateLimitedLog:
    """At most ``LOG_BURST`` warnings per ``LOG_WINDOW_S``; the rest are counted and
    reported in one line when the window ends (``tick`` is called from the daemon's loop)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.start = 0.0
        self.lines = 0
        self.suppressed = 0

    def warning(self, now: float, fmt: str, *args: object) -> None:
        self.tick(now)
        if self.lines < LOG_BURST:
            self.lines += 1
            self.log.warning(fmt, *args)
        else:
            self.suppressed += 1

    def tick(self, now: float) -> None:
        if now - self.start < LOG_WINDOW_S:
            return
        if self.suppressed:
            self.log.warning("%d more refused connections not logged in the last %.0fs",
                             self.suppressed, now - self.start)
        self.start, self.lines, self.suppressed = now, 0, 0
