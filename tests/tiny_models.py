"""Tiny random GGUF models, written with gguf.GGUFWriter inside the tests (no downloads).

The tokenizer is a byte-level BPE with one merge ("h e"): every other byte is one token,
plus BOS/EOS and two chat markers, so any text tokenizes and the vocabulary stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
}


def byte_level_vocab() -> list[str]:
    """GPT-2's byte -> printable-unicode table, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, n = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return [mapping[b] for b in range(256)]


@dataclass(frozen=True)
class TinyConfig:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    context_length: int = 128
    rope_base: float = 10000.0
    sliding_window: int = 8  # gemma3 only
    tied: bool = False
    # the output rows of the end tokens (</s>, <|im_end|>) zeroed: among ~260 random logits
    # a zero is (almost surely) never the largest, so a greedy generation runs to its limit
    endless: bool = False


def write_tiny_gguf(path: Path, cfg: TinyConfig = TinyConfig(), weight_type: str = "F16",
                    seed: int = 0, file_type: int | None = None) -> Path:
    rng = np.random.default_rng(seed)
    tokens = [*byte_level_vocab(), "<s>", "</s>", "<|im_start|>", "<|im_end|>", "he"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    if cfg.arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 3, 3, 1])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(True)
    if file_type is not None:  # general.file_type, as llama.cpp's quantizer writes it
        w.add_file_type(file_type)

    def add(name: str, shape: tuple[int, ...], scale: float = 0.2, qtype: str = "F32") -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            data += 1.0  # norm gains sit around one
        if name == "output.weight" and cfg.endless:
            data[[257, 259]] = 0.0
        if qtype == "F32":
            w.add_tensor(name, data)
        elif qtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            raw = gguf.quants.quantize(data, QTYPES[qtype])
            w.add_tensor(name, raw, raw_dtype=QTYPES[qtype])

    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    add("token_embd.weight", (vocab, cfg.n_embd), 1.0, weight_type)
    add("output_norm.weight", (cfg.n_embd,), 0.1)
    if not cfg.tied:
        add("output.weight", (vocab, cfg.n_embd), 0.2, weight_type)
    for il in range(cfg.n_layer):
        p = f"blk.{il}"
        add(f"{p}.attn_norm.weight", (cfg.n_embd,), 0.1)
        add(f"{p}.attn_q.weight", (q_dim, cfg.n_embd), 0.2, weight_type)
        add(f"{p}.attn_k.weight", (kv_dim, cfg.n_embd), 0.2, weight_type)
        add(f"{p}.attn_v.weight", (kv_dim, cfg.n_embd), 0.2, weight_type)
        add(f"{p}.attn_output.weight", (cfg.n_embd, q_dim), 0.2, weight_type)
        add(f"{p}.ffn_norm.weight", (cfg.n_embd,), 0.1)
        add(f"{p}.ffn_gate.weight", (cfg.n_ff, cfg.n_embd), 0.2, weight_type)
        add(f"{p}.ffn_up.weight", (cfg.n_ff, cfg.n_embd), 0.2, weight_type)
        add(f"{p}.ffn_down.weight", (cfg.n_embd, cfg.n_ff), 0.2, weight_type)
        if cfg.arch == "qwen2":
            for name, dim in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                add(f"{p}.{name}.bias", (dim,), 0.1)
        if cfg.arch in ("qwen3", "gemma3"):
            add(f"{p}.attn_q_norm.weight", (cfg.head_dim,), 0.1)
            add(f"{p}.attn_k_norm.weight", (cfg.head_dim,), 0.1)
        if cfg.arch == "gemma3":
            add(f"{p}.post_attention_norm.weight", (cfg.n_embd,), 0.1)
            add(f"{p}.post_ffw_norm.weight", (cfg.n_embd,), 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
