"""Qwen3: the llama body with per-head RMS norms on q and k (attn_q_norm, attn_k_norm)
before RoPE, and NEOX RoPE."""

from __future__ import annotations

from .gguf_file import GGUFFile
from .llama import ModelArgs, build, kv_heads


def args_from_gguf(f: GGUFFile) -> ModelArgs:
    return ModelArgs.from_gguf(f, rope_neox=True, qk_norm=True)


__all__ = ["args_from_gguf", "build", "kv_heads"]
