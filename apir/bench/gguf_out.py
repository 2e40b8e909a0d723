"""``apir bench --write-gguf DIR``: the ``--synthetic`` models as real GGUF files, so that
llama.cpp's ``llama-bench`` and ``apir bench -m FILE`` read the very same bytes.

A file holds the ``SyntheticFile``'s metadata and tensors byte for byte (the same random
valid blocks, so ``apir bench`` on the file computes the same tokens as on the synthetic
model), plus what llama.cpp needs to load a model and apir a tokenizer: a SentencePiece
("llama") vocabulary of the shape's size: <unk> <s> </s>, the 256 byte tokens <0x00>..
<0xFF>, then ``[N]`` filler tokens (no token splits into two others, so no merges, and
building apir's tokenizer stays cheap at 128k tokens). Benchmarks feed token ids; the
text of a token never matters.

Writing streams: the header and tensor table first, then one tensor at a time (each a
view of its dtype's random pool), so memory stays at the pools' size (the largest tensor
per dtype), never the file's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from ..graph import DType
from .errors import BenchError
from .synthetic import SyntheticFile

KT = gguf.Keys.Tokenizer
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: llama.cpp's SPM defaults
FILE_TYPES = {  # general.file_type, as llama.cpp's quantize labels its outputs
    DType.F32: gguf.LlamaFileType.ALL_F32, DType.F16: gguf.LlamaFileType.MOSTLY_F16,
    DType.BF16: gguf.LlamaFileType.MOSTLY_BF16, DType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    DType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, DType.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    DType.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}


def file_name(f: SyntheticFile) -> str:
    """``llama-8b:q4_0`` -> ``llama-8b-q4_0.gguf``."""
    return f.name.replace(":", "-") + ".gguf"


def vocabulary(n: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(tokens, scores f32, token types i32) of a SentencePiece vocabulary of ``n`` tokens."""
    if n < len(SPECIALS) + 256:
        raise BenchError(f"a vocabulary of {n} tokens cannot hold the specials and 256 byte tokens")
    tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"[{i}]" for i in range(len(tokens), n)]
    types = np.full(n, gguf.TokenType.NORMAL, np.int32)
    types[0], types[1:3] = gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL
    types[3:259] = gguf.TokenType.BYTE
    return tokens, -np.arange(n, dtype=np.float32), types


def _add_metadata(w: gguf.GGUFWriter, f: SyntheticFile) -> None:
    for key, value in f.metadata.items():
        if key == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer adds it
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_file_type(FILE_TYPES[f.dtype])
    tokens, scores, types = vocabulary(f.shape.vocab_size)
    w.add_string(KT.MODEL, "llama")
    w.add_array(KT.LIST, tokens)
    w.add_array(KT.SCORES, scores.tolist())
    w.add_array(KT.TOKEN_TYPE, types.tolist())
    w.add_uint32(KT.UNK_ID, 0)
    w.add_uint32(KT.BOS_ID, 1)
    w.add_uint32(KT.EOS_ID, 2)
    w.add_bool(KT.ADD_BOS, True)
    w.add_bool(KT.ADD_EOS, False)


def write_gguf(f: SyntheticFile, path: str | Path) -> Path:
    """Write ``f`` to ``path`` (through a temporary file beside it, renamed when whole)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.part")
    tensors = list(f.tensors.values())
    w = gguf.GGUFWriter(tmp, f.arch)
    try:
        _add_metadata(w, f)
        for t in tensors:  # numpy-order shape and the GGML type: no conversion of the bytes
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.data.nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(int(t.dtype)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            w.write_tensor_data(t.data)
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        w.close()
        tmp.unlink(missing_ok=True)
        raise BenchError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def write_all(specs: list[str], out_dir: str | Path, log: Callable[[str], None]) -> list[Path]:
    """Write each ``--synthetic`` spec into ``out_dir`` (made if missing)."""
    out = Path(out_dir)
    files = [SyntheticFile.from_spec(s) for s in specs]  # every spec checked before writing
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot make {out}: {e.strerror or e}") from None
    paths = []
    for f in files:
        path = out / file_name(f)
        write_gguf(f, path)
        log(f"wrote {path} ({path.stat().st_size / 2**20:,.1f} MiB)")
        paths.append(path)
    return paths
