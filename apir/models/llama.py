"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral), also the body of qwen2 and qwen3.

Per block, with GGUF tensor names:
    h   = x + attn_output( attention( rope(attn_q(n)), rope(attn_k(n)), attn_v(n) ) )
          where n = rms_norm(x) * attn_norm
    out = h + ffn_down( silu(ffn_gate(m)) * ffn_up(m) ),  m = rms_norm(h) * ffn_norm
qwen2 adds biases to q/k/v; qwen3 rms-normalises q and k per head (attn_q_norm, attn_k_norm).
llama uses "normal" (interleaved) RoPE because llama.cpp's converter permutes q/k; the
qwen models use NEOX RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

from ..graph import GraphBuilder, T, Value
from .errors import ModelLoadError
from .gguf_file import GGUFFile
from .slots import SlotCache
from .weights import KVCache, Weights

K = gguf.Keys


@dataclass(frozen=True)
class ModelArgs:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    context_length: int
    rope_neox: bool = False
    rope_freq_scale: float = 1.0
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.n_head <= 0 or self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise ModelLoadError(f"head counts {self.n_head}/{self.n_head_kv} are not a valid GQA layout")
        if not 0 < self.rope_dims <= self.head_dim:
            raise ModelLoadError(f"rope dimension {self.rope_dims} exceeds head size {self.head_dim}")

    @classmethod
    def from_gguf(cls, f: GGUFFile, **overrides) -> ModelArgs:
        n_embd = int(f.require(K.LLM.EMBEDDING_LENGTH))
        n_head = int(f.require(K.Attention.HEAD_COUNT))
        head_dim = int(f.get(K.Attention.KEY_LENGTH, n_embd // n_head))
        vocab = f.get(K.LLM.VOCAB_SIZE) or f.tensor("token_embd.weight").shape[0]
        scaling = f.get(K.Rope.SCALING_TYPE, "none")
        freq_scale = 1.0
        if scaling == "linear":
            freq_scale = 1.0 / float(f.get(K.Rope.SCALING_FACTOR, 1.0))
        elif scaling not in ("none", None):
            raise ModelLoadError(f"RoPE scaling type {scaling!r} is not supported")
        return cls(
            n_layer=int(f.require(K.LLM.BLOCK_COUNT)),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(f.get(K.Attention.HEAD_COUNT_KV, n_head)),
            head_dim=head_dim,
            n_ff=int(f.require(K.LLM.FEED_FORWARD_LENGTH)),
            vocab_size=int(vocab),
            rms_eps=float(f.get(K.Attention.LAYERNORM_RMS_EPS, 1e-5)),
            rope_base=float(f.get(K.Rope.FREQ_BASE, 10000.0)),
            rope_dims=int(f.get(K.Rope.DIMENSION_COUNT, head_dim)),
            context_length=int(f.get(K.LLM.CONTEXT_LENGTH, 2048)),
            rope_freq_scale=freq_scale,
            **overrides,
        )


def norm(g: GraphBuilder, x: Value, w: Value, eps: float) -> Value:
    return g.mul(g.rms_norm(x, eps), w)


def linear(g: GraphBuilder, x: Value, w: Weights, name: str, bias: bool = False) -> Value:
    y = g.matmul(x, w[f"{name}.weight"], label=name)
    return g.add(y, w[f"{name}.bias"]) if bias else y


def attention_block(
    g: GraphBuilder, a: ModelArgs, w: Weights, il: int, x: Value, pos: Value, kv: KVCache | SlotCache,
    rope_base: float, window: int = 0, scale: float | None = None,
) -> Value:
    """q/k/v projections, optional q/k norm, RoPE, cached attention, output projection."""
    p = f"blk.{il}"
    q = g.reshape(linear(g, x, w, f"{p}.attn_q", a.qkv_bias), (T, a.n_head, a.head_dim))
    k = g.reshape(linear(g, x, w, f"{p}.attn_k", a.qkv_bias), (T, a.n_head_kv, a.head_dim))
    v = g.reshape(linear(g, x, w, f"{p}.attn_v", a.qkv_bias), (T, a.n_head_kv, a.head_dim))
    if a.qk_norm:
        q = norm(g, q, w[f"{p}.attn_q_norm.weight"], a.rms_eps)
        k = norm(g, k, w[f"{p}.attn_k_norm.weight"], a.rms_eps)
    q = g.rope(q, pos, a.rope_dims, rope_base, a.rope_neox, a.rope_freq_scale)
    k = g.rope(k, pos, a.rope_dims, rope_base, a.rope_neox, a.rope_freq_scale)
    scale = 1.0 / math.sqrt(a.head_dim) if scale is None else scale
    out = kv.attend(g, il, q, k, v, pos, scale, window)  # (T, H, D)
    return linear(g, g.reshape(out, (T, a.n_head * a.head_dim)), w, f"{p}.attn_output")


def build(
    g: GraphBuilder, a: ModelArgs, w: Weights, tokens: Value, pos: Value, kv: KVCache | SlotCache,
    last_only: bool | Value,
) -> Value:
    """Logits for ``tokens`` at ``pos``: (T, vocab), (1, vocab) when ``last_only``, or one
    row per index of a ``last_only`` value (see ``head``)."""
    x = g.get_rows(w["token_embd.weight"], tokens)  # (T, n_embd)
    for il in range(a.n_layer):
        n = norm(g, x, w[f"blk.{il}.attn_norm.weight"], a.rms_eps)
        x = g.add(x, attention_block(g, a, w, il, n, pos, kv, a.rope_base))
        m = norm(g, x, w[f"blk.{il}.ffn_norm.weight"], a.rms_eps)
        ff = g.swiglu(linear(g, m, w, f"blk.{il}.ffn_gate"), linear(g, m, w, f"blk.{il}.ffn_up"))
        x = g.add(x, linear(g, ff, w, f"blk.{il}.ffn_down"))
    return head(g, a, w, x, last_only)


def head(g: GraphBuilder, a: ModelArgs, w: Weights, x: Value, last_only: bool | Value) -> Value:
    """The output norm and projection of the hidden states x (T, n_embd): of every row, of
    the last one (``last_only`` True), or of the rows a (B,) I32 value ``last_only`` picks
    (each sequence's last of a batched step)."""
    if last_only is True:
        x = g.view(x, 0, -1, 1)
    elif last_only is not False:
        x = g.get_rows(x, last_only)
    x = norm(g, x, w["output_norm.weight"], a.rms_eps)
    return g.matmul(x, w.output(), label="output")


def args_from_gguf(f: GGUFFile) -> ModelArgs:
    return ModelArgs.from_gguf(f)


def kv_heads(a: ModelArgs) -> list[tuple[int, int, int]]:
    """Per layer (n_head_kv, key dim, value dim): the KV-cache shape."""
    return [(a.n_head_kv, a.head_dim, a.head_dim)] * a.n_layer
