"""Generation: a model on a backend, its KV cache, sampling and streaming."""

from __future__ import annotations

from ..backends import Backend, ExecutorConfig, create_backend
from ..models.gguf_file import GGUFFile
from ..models.resolve import resolve_model
from .model import ContextOverflowError, Model, Progress, SamplingParams


def load(
    model: str | None = None, backend: str | Backend = "local", device: str | None = None,
    n_ctx: int | None = None, progress: Progress | None = None, remote: str | None = None,
    token_file: str | None = None,
) -> Model:
    """Open ``model`` (a known name, a .gguf path, or None for the default) on ``backend``.

    ``backend="remote"`` forwards every graph to the host daemon at ``remote``.
    """
    gguf = GGUFFile(resolve_model(model))
    if isinstance(backend, str):
        be = create_backend(backend, device, remote=remote, token_file=token_file,
                            config=ExecutorConfig.from_env())
    else:
        be = backend
    try:
        return Model(gguf, be, n_ctx=n_ctx, progress=progress)
    except BaseException:
        be.close()
        raise


__all__ = ["ContextOverflowError", "Model", "SamplingParams", "load"]
