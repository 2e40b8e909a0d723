"""Architectures by GGUF ``general.architecture``.

Each module exports ``args_from_gguf(GGUFFile) -> ModelArgs``, ``kv_heads(args)`` and
``build(g, args, weights, tokens, pos, kv, last_only) -> logits``.
"""

from __future__ import annotations

from types import ModuleType

from . import gemma3, llama, qwen2, qwen3
from .errors import ModelLoadError

ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
}


def architecture(name: str) -> ModuleType:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelLoadError(
            f"unsupported architecture {name!r}: apir runs {supported}"
        ) from None
