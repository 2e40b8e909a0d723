"""Generation: a model on a backend, its KV cache, sampling and streaming."""

from __future__ import annotations

from ..backends import Backend, create_backend
from ..models.gguf_file import GGUFFile
from ..models.resolve import resolve_model
from .model import ContextOverflowError, Model, Progress, SamplingParams


def load(
    model: str | None = None, backend: str | Backend = "local", device: str | None = None,
    n_ctx: int | None = None, progress: Progress | None = None,
) -> Model:
    """Open ``model`` (a known name, a .gguf path, or None for the default) on ``backend``."""
    gguf = GGUFFile(resolve_model(model))
    be = create_backend(backend, device) if isinstance(backend, str) else backend
    try:
        return Model(gguf, be, n_ctx=n_ctx, progress=progress)
    except BaseException:
        be.close()
        raise


__all__ = ["ContextOverflowError", "Model", "SamplingParams", "load"]
