"""The KV cache's dtype: F16 by default (llama.cpp's), F32 on request (``--cache-type``)."""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import pytest

from apir.backends import create_backend
from apir.bench.synthetic import SyntheticFile
from apir.engine.model import Model
from apir.flags import add_backend, run_config
from apir.graph import DType
from apir.models.errors import ModelLoadError

BACKENDS = ["numpy"] + (["local"] if importlib.util.find_spec("torch") else [])
PROMPT = [1, 300, 17, 4, 499, 258, 77, 12, 90, 3, 141, 59]


def load(backend: str, cache_type: DType | None = None) -> Model:
    return Model(SyntheticFile.from_spec("llama-tiny:q8_0"), create_backend(backend, "cpu"), n_ctx=64,
                 cache_type=cache_type)


@pytest.mark.parametrize("backend", BACKENDS)
def test_f16_cache_by_default_half_the_bytes_of_f32(backend: str) -> None:
    with load(backend) as f16, load(backend, DType.F32) as f32:
        assert f16.kv.dtype is DType.F16 and f32.kv.dtype is DType.F32
        slot16, slot32 = f16.kv.layers[0][0], f32.kv.layers[0][0]
        assert slot16.dtype is DType.F16 and slot16.shape == slot32.shape == (64, 2, 16)
        assert 2 * f16.backend.buffer_size(f16.kv.buffer) == f32.backend.buffer_size(f32.kv.buffer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_f16_cache_logits_are_close_to_f32_and_decode_continues_them(backend: str) -> None:
    """Chunked prefill then decode read back what SET_ROWS cast into the F16 cache."""
    with load(backend) as f16, load(backend, DType.F32) as f32:
        a, b = f16.logits(PROMPT), f32.logits(PROMPT)
        np.testing.assert_allclose(a, b, atol=2e-3 * float(np.abs(b).max()))
        f16.logits(PROMPT[:5])
        np.testing.assert_allclose(f16.logits(PROMPT[5:], start=5), a[5:], rtol=0, atol=1e-5)
        first = f16.prefill(PROMPT)
        gen = f16.decode_steps(first, len(PROMPT), 4)
        assert f16.logits([*PROMPT, first, *gen[:-1]])[len(PROMPT) - 1:].argmax(-1).tolist() == [first, *gen]


@pytest.mark.skipif("local" not in BACKENDS, reason="needs torch")
def test_f16_cache_tokens_agree_between_local_and_numpy() -> None:
    runs = []
    for backend in ("local", "numpy"):
        with load(backend) as m:
            first = m.prefill(PROMPT)
            runs.append([first, *m.decode_steps(first, len(PROMPT), 8)])
    assert runs[0] == runs[1]


def test_an_unsupported_cache_type_fails_before_any_upload() -> None:
    backend = create_backend("numpy")
    with pytest.raises(ModelLoadError, match="the KV cache holds f16 or f32, not BF16"):
        Model(SyntheticFile.from_spec("llama-tiny:f16"), backend, n_ctx=8, cache_type=DType.BF16)
    assert backend.allocated_bytes() == 0


def test_cache_type_flag() -> None:
    p = argparse.ArgumentParser()
    add_backend(p)
    assert run_config(p.parse_args([])).cache_type is None
    assert run_config(p.parse_args(["--cache-type", "f32"])).cache_type == "f32"
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-type", "q8_0"])


def test_run_config_cache_type_reaches_the_model(tmp_path) -> None:
    from apir.bench.gguf_out import write_gguf
    from apir.flags import RunConfig
    from apir.flags import load as load_config

    path = write_gguf(SyntheticFile.from_spec("llama-tiny:f16"), tmp_path / "tiny.gguf")
    with load_config(RunConfig(str(path), backend="numpy", ctx_size=16, cache_type="f32"),
                     say=lambda line: None) as m:
        assert m.kv.dtype is DType.F32
    with pytest.raises(ValueError, match="--cache-type must be one of f16, f32, got 'q4_0'"):
        RunConfig(cache_type="q4_0")
