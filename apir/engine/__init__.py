"""Generation: a model on a backend, its KV cache, sampling and streaming."""

from __future__ import annotations

from pathlib import Path

from ..backends import DEFAULT_EXECUTOR, Backend, ExecutorConfig, create_backend
from ..graph import DType
from ..models.gguf_file import GGUFFile
from ..models.resolve import DEFAULT_CACHE_DIR, resolve_model
from .model import ContextOverflowError, Model, Progress, SamplingParams


def load(
    model: str | Path | None = None, backend: str | Backend = "local", device: str | None = None,
    n_ctx: int | None = None, progress: Progress | None = None, remote: str | None = None,
    token: str = "", spin_us: int | None = None, cache_dir: Path = DEFAULT_CACHE_DIR,
    executor: ExecutorConfig = DEFAULT_EXECUTOR, cache_type: DType | None = None,
) -> Model:
    """Open ``model`` (a known name, a .gguf path, or None for the default) on ``backend``.

    ``backend="remote"`` forwards every graph to the host daemon at ``remote`` (``token``:
    its shared secret over tcp/vsock; ``spin_us``: see ``RemoteBackend``).
    ``cache_type`` is the KV cache's dtype (``Model``). Everything
    comes from the arguments: no environment variable or config file is read here.
    """
    gguf = GGUFFile(resolve_model(None if model is None else str(model), cache_dir))
    if isinstance(backend, str):
        be = create_backend(backend, device, remote, token, executor, spin_us)
    else:
        be = backend
    try:
        return Model(gguf, be, n_ctx=n_ctx, progress=progress, cache_type=cache_type)
    except BaseException:
        be.close()
        raise


__all__ = ["ContextOverflowError", "Model", "SamplingParams", "load"]
