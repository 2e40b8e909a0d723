"""Gemma 3 (text): llama-like attention with Q/K norms, sandwich norms and GELU.

Per block, with GGUF tensor names:
    a   = post_attention_norm( attention(rms_norm(x) * attn_norm) )
    h   = x + a
    f   = post_ffw_norm( ffn_down( gelu(ffn_gate(m)) * ffn_up(m) ) ),  m = rms_norm(h) * ffn_norm
    out = h + f
The token embedding is scaled by sqrt(n_embd). Five of every six layers use sliding-window
attention with their own RoPE base (10 000); every sixth is global (the model's base).
RoPE is NEOX. The converter already folded Gemma's "1 + weight" into the norm gains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

from ..graph import GraphBuilder, Value
from .gguf_file import GGUFFile
from .llama import ModelArgs as LlamaArgs
from .llama import attention_block, head, linear, norm
from .slots import SlotCache
from .weights import KVCache, Weights

K = gguf.Keys
SWA_PATTERN = 6  # layer il is global when (il + 1) % 6 == 0, as in llama.cpp
SWA_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ModelArgs(LlamaArgs):
    sliding_window: int = 0
    attn_scale: float = 1.0

    def is_sliding(self, il: int) -> bool:
        return self.sliding_window > 0 and (il + 1) % SWA_PATTERN != 0


def args_from_gguf(f: GGUFFile) -> ModelArgs:
    base = LlamaArgs.from_gguf(f, rope_neox=True, qk_norm=True)
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    return ModelArgs(
        **fields,
        sliding_window=int(f.get(K.Attention.SLIDING_WINDOW, 0)),
        attn_scale=1.0 / math.sqrt(base.head_dim),
    )


def kv_heads(a: ModelArgs) -> list[tuple[int, int, int]]:
    return [(a.n_head_kv, a.head_dim, a.head_dim)] * a.n_layer


def build(
    g: GraphBuilder, a: ModelArgs, w: Weights, tokens: Value, pos: Value, kv: KVCache | SlotCache,
    last_only: bool | Value,
) -> Value:
    """Logits for ``tokens`` at ``pos``: rows as ``llama.head`` picks them."""
    x = g.scale(g.get_rows(w["token_embd.weight"], tokens), math.sqrt(a.n_embd))
    for il in range(a.n_layer):
        p = f"blk.{il}"
        sliding = a.is_sliding(il)
        n = norm(g, x, w[f"{p}.attn_norm.weight"], a.rms_eps)
        att = attention_block(
            g, a, w, il, n, pos, kv,
            rope_base=SWA_ROPE_BASE if sliding else a.rope_base,
            window=a.sliding_window if sliding else 0, scale=a.attn_scale,
        )
        x = g.add(x, norm(g, att, w[f"{p}.post_attention_norm.weight"], a.rms_eps))
        m = norm(g, x, w[f"{p}.ffn_norm.weight"], a.rms_eps)
        ff = g.geglu(linear(g, m, w, f"{p}.ffn_gate"), linear(g, m, w, f"{p}.ffn_up"))
        ff = linear(g, ff, w, f"{p}.ffn_down")
        x = g.add(x, norm(g, ff, w[f"{p}.post_ffw_norm.weight"], a.rms_eps))
    return head(g, a, w, x, last_only)
