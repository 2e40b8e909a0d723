"""Transport addresses: ``unix://PATH``, ``tcp://HOST:PORT``, ``vsock://CID:PORT``."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import ApirError

DEFAULT_TCP_PORT = 7070


class AddressError(ApirError):
    """An address apir cannot parse or use."""


def default_socket_path() -> Path:
    """$XDG_RUNTIME_DIR/apir/apir.sock, else /tmp/apir-UID/apir.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "apir" if runtime else Path(f"/tmp/apir-{os.getuid()}")
    return base / "apir.sock"


@dataclass(frozen=True)
class Address:
    scheme: str  # unix | tcp | vsock
    path: str = ""  # unix
    host: str = ""  # tcp
    port: int = 0  # tcp, vsock
    cid: int = 0  # vsock

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        if self.scheme == "tcp":
            return f"tcp://{self.host}:{self.port}"
        return f"vsock://{self.cid}:{self.port}"

    @property
    def family(self) -> int:
        if self.scheme == "unix":
            return socket.AF_UNIX
        if self.scheme == "vsock":
            if not hasattr(socket, "AF_VSOCK"):
                raise AddressError("this Python has no AF_VSOCK support (Linux only)")
            return socket.AF_VSOCK
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    @property
    def sockaddr(self) -> str | tuple[str, int] | tuple[int, int]:
        if self.scheme == "unix":
            return self.path
        if self.scheme == "vsock":
            return (self.cid, self.port)
        return (self.host, self.port)


def parse_address(url: str | None) -> Address:
    """Parse a transport URL; ``None``/``""``/``auto`` mean the default Unix socket."""
    if url in (None, "", "auto", "unix://"):
        return Address("unix", path=str(default_socket_path()))
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise AddressError(f"bad address {url!r}: use unix:///path, tcp://host:port or vsock://cid:port")
    if scheme == "unix":
        if not rest:
            raise AddressError(f"bad address {url!r}: unix:// needs a socket path")
        return Address("unix", path=rest)
    if scheme in ("tcp", "vsock"):
        host, colon, port = rest.rpartition(":")
        if not colon:
            host, port = rest, str(DEFAULT_TCP_PORT)
        try:
            port_n = int(port)
        except ValueError:
            raise AddressError(f"bad port in {url!r}") from None
        if not 0 <= port_n < 65536:
            raise AddressError(f"port {port_n} out of range in {url!r}")
        if scheme == "tcp":
            return Address("tcp", host=host.strip("[]") or "127.0.0.1", port=port_n)
        try:
            return Address("vsock", cid=int(host), port=port_n)
        except ValueError:
            raise AddressError(f"bad vsock CID in {url!r}: use a number, e.g. vsock://2:7070") from None
    raise AddressError(f"unknown transport {scheme!r} in {url!r}: use unix, tcp or vsock")
