"""Llama models of real shapes with random weights, made in memory: no download, no file.

``SyntheticFile`` offers what the engine reads from a ``GGUFFile`` (``arch``, ``get``,
``require``, ``tensor``, ``tensors``, ``nbytes``, ``quantization``, ``path``) and no
tokenizer (``has_tokenizer`` is False): a benchmark feeds token ids directly.

Weights are cheap to make: one random block of valid values per dtype (1 MiB) is tiled
into a pool as large as the largest tensor, and every tensor is a zero-copy view of the
pool's first bytes. The values are small (std ~0.02) and finite: block types get random
quant bytes under fixed f16 scales. Norm weights are ones in F32, as GGUF stores them.

``q4_k`` is a Q4_K_M-like mix, as llama.cpp's quantize makes it: Q6_K for the output (the
token embedding when tied) and for attn_v / ffn_down in the layers ``use_more_bits``
picks (about half), Q4_K elsewhere; a K-type tensor whose rows are not whole 256-element
blocks falls back as llama.cpp's does (Q4_K -> Q5_0, Q6_K -> Q8_0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import PurePosixPath

import gguf
import numpy as np

from ..graph import DType
from ..models.gguf_file import TensorInfo
from .errors import BenchError

K = gguf.Keys
BLOCK_BYTES = 1 << 20  # the random block each dtype's pool is tiled from
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    """A llama-architecture shape, as its GGUF metadata would describe it."""

    name: str
    description: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    vocab_size: int
    head_dim: int
    rope_base: float
    tied: bool
    context_length: int

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF tensor name, numpy-order shape) of every tensor; 1-D ones are norms."""
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", (self.vocab_size, self.n_embd))]
        for il in range(self.n_layer):
            p = f"blk.{il}"
            out += [
                (f"{p}.attn_norm.weight", (self.n_embd,)),
                (f"{p}.attn_q.weight", (q, self.n_embd)),
                (f"{p}.attn_k.weight", (kv, self.n_embd)),
                (f"{p}.attn_v.weight", (kv, self.n_embd)),
                (f"{p}.attn_output.weight", (self.n_embd, q)),
                (f"{p}.ffn_norm.weight", (self.n_embd,)),
                (f"{p}.ffn_gate.weight", (self.n_ff, self.n_embd)),
                (f"{p}.ffn_up.weight", (self.n_ff, self.n_embd)),
                (f"{p}.ffn_down.weight", (self.n_embd, self.n_ff)),
            ]
        out.append(("output_norm.weight", (self.n_embd,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab_size, self.n_embd)))
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensor_shapes())


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-tiny", "2 layers, 64 wide: for tests", 2, 64, 4, 2, 128, 512, 16, 10000.0,
              True, 2048),
        Shape("llama-135m", "SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 64, 100000.0, True, 8192),
        Shape("llama-1b", "Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, 64, 500000.0, True, 131072),
        Shape("llama-8b", "Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 128, 500000.0, False, 131072),
        Shape("llama-70b", "Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 128, 500000.0, False, 131072),
    )
}
WEIGHT_DTYPES = {"f16": DType.F16, "bf16": DType.BF16, "q8_0": DType.Q8_0, "f32": DType.F32,
                 "q4_0": DType.Q4_0, "q4_k": DType.Q4_K, "q6_k": DType.Q6_K}
# per block type: byte offsets of its f16 scales (d, dmin), and d for values of std ~WEIGHT_STD
# when every other byte is random (quants uniform; K sub-scales ~32, Q6_K's int8 ones ~74)
SCALES: dict[DType, tuple[tuple[int, ...], float]] = {
    DType.Q4_0: ((0,), WEIGHT_STD / 4.6),
    DType.Q5_0: ((0,), WEIGHT_STD / 9.2),
    DType.Q8_0: ((0,), WEIGHT_STD / 74.0),
    DType.Q4_K: ((0, 2), WEIGHT_STD / (32 * 4.6)),
    DType.Q6_K: ((208,), WEIGHT_STD / (74 * 18.5)),
}
K_FALLBACK = {DType.Q4_K: DType.Q5_0, DType.Q6_K: DType.Q8_0}  # rows not whole 256-blocks


def use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in *_K_M."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def parse_spec(spec: str) -> tuple[Shape, DType]:
    """``llama-1b`` or ``llama-1b:q8_0`` -> (shape, weight dtype); f16 by default."""
    name, _, dtype = spec.strip().lower().partition(":")
    if name not in SHAPES:
        raise BenchError(f"unknown synthetic shape {name!r}: choose one of {', '.join(SHAPES)}")
    dtype = dtype or "f16"
    if dtype not in WEIGHT_DTYPES:
        raise BenchError(
            f"unknown weight type {dtype!r} in {spec!r}: choose one of {', '.join(WEIGHT_DTYPES)}"
        )
    return SHAPES[name], WEIGHT_DTYPES[dtype]


def random_block(dtype: DType, nbytes: int, seed: int = 0) -> np.ndarray:
    """About ``nbytes`` of valid random ``dtype`` data (whole elements/blocks), as uint8."""
    rng = np.random.default_rng(seed)
    if dtype in SCALES:
        offsets, d = SCALES[dtype]
        blocks = rng.integers(0, 256, (max(1, nbytes // dtype.type_size), dtype.type_size), np.uint8)
        for off in offsets:
            blocks[:, off : off + 2] = np.full((1, 1), d, np.float16).view(np.uint8)
        return blocks.reshape(-1)
    n = max(1, nbytes // dtype.type_size)
    x = (rng.standard_normal(n, np.float32) * WEIGHT_STD).astype(np.float32)
    if dtype is DType.F16:
        return x.astype(np.float16).view(np.uint8)
    if dtype is DType.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if dtype is DType.F32:
        return x.view(np.uint8)
    raise BenchError(f"no random data for {dtype.name}")


class SyntheticFile:
    """A llama model of ``shape`` with random ``dtype`` weights, duck-typed as a GGUFFile."""

    arch = "llama"
    has_tokenizer = False  # token ids only

    def __init__(self, shape: Shape, dtype: DType = DType.F16) -> None:
        self.shape, self.dtype = shape, dtype
        self.name = f"{shape.name}:{dtype.name.lower()}"
        self.path = PurePosixPath(self.name)
        self._meta = {
            K.General.ARCHITECTURE: "llama",
            K.General.NAME: f"{self.name} (synthetic {shape.description})",
            K.LLM.BLOCK_COUNT: shape.n_layer,
            K.LLM.CONTEXT_LENGTH: shape.context_length,
            K.LLM.EMBEDDING_LENGTH: shape.n_embd,
            K.LLM.FEED_FORWARD_LENGTH: shape.n_ff,
            K.LLM.VOCAB_SIZE: shape.vocab_size,
            K.Attention.HEAD_COUNT: shape.n_head,
            K.Attention.HEAD_COUNT_KV: shape.n_head_kv,
            K.Attention.KEY_LENGTH: shape.head_dim,
            K.Attention.VALUE_LENGTH: shape.head_dim,
            K.Attention.LAYERNORM_RMS_EPS: 1e-5,
            K.Rope.DIMENSION_COUNT: shape.head_dim,
            K.Rope.FREQ_BASE: shape.rope_base,
        }
        self._meta = {k.format(arch=self.arch): v for k, v in self._meta.items()}

    @classmethod
    def from_spec(cls, spec: str) -> SyntheticFile:
        return cls(*parse_spec(spec))

    def _dtype_of(self, name: str, shape: tuple[int, ...]) -> DType:
        if len(shape) != 2:
            return DType.F32
        dtype = self.dtype
        if dtype is DType.Q4_K:  # the Q4_K_M-like mix (see the module's docstring)
            parts = name.split(".")
            output = name == ("token_embd.weight" if self.shape.tied else "output.weight")
            more = parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") \
                and use_more_bits(int(parts[1]), self.shape.n_layer)
            dtype = DType.Q6_K if output or more else dtype
        return K_FALLBACK.get(dtype, dtype) if shape[1] % dtype.block_size else dtype

    @property
    def metadata(self) -> dict:
        """Every metadata key (``{arch}`` filled in) and its value, as a GGUF file holds them."""
        return dict(self._meta)

    def get(self, key: str, default=None):
        return self._meta.get(key.format(arch=self.arch), default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise BenchError(f"{self.name}: metadata key {key.format(arch=self.arch)} is missing")
        return value

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor, made on first use (views of one random pool per dtype)."""
        specs = [(name, shape, self._dtype_of(name, shape)) for name, shape in self.shape.tensor_shapes()]
        largest: dict[DType, int] = {}
        for _, shape, dtype in specs:
            if len(shape) == 2:
                largest[dtype] = max(largest.get(dtype, 0), dtype.nbytes(shape))
        pools = {}
        for dtype, size in largest.items():
            block = random_block(dtype, BLOCK_BYTES)
            pools[dtype] = np.tile(block, -(-size // block.nbytes))
        ones = np.ones(self.shape.n_embd, np.float32).view(np.uint8)  # every norm is n_embd wide
        return {name: TensorInfo(name, dtype, shape, pools[dtype][: dtype.nbytes(shape)] if len(shape) == 2 else ones)
                for name, shape, dtype in specs}

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise BenchError(f"{self.name}: tensor {name} is missing") from None

    @property
    def n_params(self) -> int:
        return self.shape.n_params

    @property
    def nbytes(self) -> int:
        """Bytes of all weights, computed from the shapes (nothing is allocated)."""
        return sum(self._dtype_of(n, s).nbytes(s) for n, s in self.shape.tensor_shapes())

    def quantization(self) -> str:
        return self.dtype.name
