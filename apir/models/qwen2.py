"""Qwen2: the llama body with biases on the q/k/v projections and NEOX RoPE."""

from __future__ import annotations

from .gguf_file import GGUFFile
from .llama import ModelArgs, build, kv_heads


def args_from_gguf(f: GGUFFile) -> ModelArgs:
    return ModelArgs.from_gguf(f, rope_neox=True, qkv_bias=True)


__all__ = ["args_from_gguf", "build", "kv_heads"]
