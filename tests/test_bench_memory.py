"""apir bench: the quantized synthetic types (q4_0, q6_k, the Q4_K_M-like q4_k mix) and the
``gpu_memory`` field of every record."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from apir.bench.synthetic import SyntheticFile, use_more_bits
from apir.cli import main
from apir.graph import DType

HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_q4_k_is_the_q4_k_m_mix_llama_cpp_makes() -> None:
    f = SyntheticFile.from_spec("llama-8b:q4_k")
    dtypes = {name: f._dtype_of(name, shape) for name, shape in f.shape.tensor_shapes()}
    assert dtypes["output.weight"] is DType.Q6_K and dtypes["token_embd.weight"] is DType.Q4_K
    more = [il for il in range(32) if dtypes[f"blk.{il}.attn_v.weight"] is DType.Q6_K]
    assert more == [il for il in range(32) if use_more_bits(il, 32)]
    assert more[:5] == [0, 1, 2, 3, 6] and 12 <= len(more) <= 20  # about half, as llama.cpp
    assert all(dtypes[f"blk.{il}.ffn_down.weight"] is dtypes[f"blk.{il}.attn_v.weight"] for il in range(32))
    assert {dtypes[f"blk.{il}.attn_q.weight"] for il in range(32)} == {DType.Q4_K}
    assert "tensors" not in f.__dict__  # typing the tensors made none of them


@pytest.mark.parametrize(("spec", "types"), [
    ("llama-tiny:q4_0", {DType.Q4_0}),
    # 576-wide rows are not whole 256-blocks: llama.cpp's fallbacks, Q6_K's for the tied output
    ("llama-135m:q4_k", {DType.Q4_K, DType.Q6_K, DType.Q5_0, DType.Q8_0}),
    ("llama-135m:q6_k", {DType.Q6_K, DType.Q8_0}),
])
def test_quantized_synthetic_weights_are_valid_and_small(spec: str, types: set[DType]) -> None:
    f = SyntheticFile.from_spec(spec)
    matrices = [t for t in f.tensors.values() if len(t.shape) == 2]
    assert {t.dtype for t in matrices} == types
    assert f.nbytes == sum(t.data.nbytes for t in f.tensors.values())
    for t in matrices:
        rows = t.data.reshape(t.shape[0], -1)[:8]
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(t.dtype)))
        assert np.isfinite(values).all() and 0.01 < float(np.std(values)) < 0.05, t.name


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("int4", ["0", "1"])
def test_every_record_says_what_the_host_holds(capsys, tmp_path: Path, monkeypatch, int4: str) -> None:
    """Blocks only (a GPU host's default, on this CPU too), or with the int4 forms a CPU
    makes of Q4_0 weights at their first step: the remote session's published bytes
    include those too (they were left out until its next non-step request)."""
    monkeypatch.setenv("APIR_DEQUANT_CACHE", "0")
    monkeypatch.setenv("APIR_CPU_INT4", int4)
    code = main(["bench", "--synthetic", "llama-tiny:q4_0", "-p", "8", "-n", "4", "-r", "1",
                 "--backends", "native,remote-shm", "--device", "cpu", "-o", "json",
                 "--history", str(tmp_path / "history.jsonl")])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = json.loads(out)
    memory = {r["backend"]: r["gpu_memory"] for r in records}
    assert set(memory) == {"native", "remote-shm"}
    native, remote = memory["native"], memory["remote-shm"]
    # the same guest allocates the same buffers on both, the executors derive the same forms
    assert native == remote
    size = records[0]["model_size"]
    assert size < native["allocated"] <= native["peak"] < 3 * size
