"""Backends: the interface and its executors. Only ``local`` imports torch, and only when asked for."""

from __future__ import annotations

from .base import (
    DEFAULT_EXECUTOR,
    Backend,
    BackendError,
    BufferPurpose,
    DeviceInfo,
    ExecutorConfig,
    Limits,
    QuotaError,
)

BACKENDS = ("local", "numpy", "remote")


def create_backend(name: str = "local", device: str | None = None, remote: str | None = None,
                   token: str = "", config: ExecutorConfig = DEFAULT_EXECUTOR,
                   spin_us: int | None = None, arena_size: int | None = None) -> Backend:
    """A backend by name: ``local`` (PyTorch on ``device``, run as ``config`` says), ``numpy``
    (reference), or ``remote`` (forwarded to the host daemon at ``remote``, e.g.
    ``unix:///run/apir.sock``, with ``token`` for tcp/vsock, ``spin_us`` of busy-polling and
    a shared arena of ``arena_size`` bytes on a Unix socket, the host's cap permitting: see
    ``RemoteBackend``). Reads no environment: the caller resolved all of it."""
    if arena_size is not None and name != "remote":
        raise BackendError(f"arena_size is for the remote backend (shared memory with its host), "
                           f"not {name!r}")
    if name == "numpy":
        if device not in (None, "cpu"):
            raise BackendError(f"the numpy backend runs on the cpu only, not {device!r}")
        from .numpy_ref import NumpyBackend

        return NumpyBackend()
    if name == "local":
        try:
            from .local import LocalBackend
        except ImportError as e:
            raise BackendError(
                f"the local backend needs PyTorch ({e}); install it with: pip install 'apir[host]'"
            ) from None
        return LocalBackend(device, config=config)
    if name == "remote":
        from .remote import DEFAULT_ARENA, RemoteBackend

        return RemoteBackend(remote, device=device, token=token, spin_us=spin_us,
                             arena_size=DEFAULT_ARENA if arena_size is None else arena_size)
    raise BackendError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS", "Backend", "BackendError", "BufferPurpose", "DeviceInfo", "ExecutorConfig", "Limits",
    "QuotaError", "create_backend",
]
