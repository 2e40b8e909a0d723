"""apir: run LLM inference in a GPU-less guest at the speed of the host's GPU.

The guest keeps the application (GGUF model, tokenizer, graphs, sampling policy) and
executes its tensor graphs on a backend: in-process (``local``, PyTorch), the numpy
reference (``numpy``), or a host daemon over a shared-memory transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ApirError

if TYPE_CHECKING:
    from .engine import Model

__version__ = "0.1.0"


def load(model: str | None = None, backend: str = "local", device: str | None = None, **kwargs) -> Model:
    """Load a GGUF model by name or path; see ``apir.engine.load``. The library's edge:
    only the arguments and library defaults count, never ``APIR_*`` or the config file."""
    from .engine import load as _load

    return _load(model, backend=backend, device=device, **kwargs)


__all__ = ["ApirError", "load", "__version__"]
