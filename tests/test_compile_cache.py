"""Compiled programs outlive the session (``ExecutorConfig.compile_cache``): a second
session with the same graph loads its compiled decode step from the cache directory
instead of compiling it (Inductor's counters say which happened), a corrupt entry is
compiled again, not trusted, and tokens are those of an eager run throughout.

On the CPU this needs ``compile_cpu`` (Inductor's C++ build, gcc); the CUDA path, where
decode steps compile by default, has its own test (marked gpu). A "session" here is a backend in this process
after ``torch._dynamo.reset()``, which drops every compiled frame: what is left is the
directory, as for a new worker process (one process saves two torch imports)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.backends.base import ExecutorConfig
from apir.engine import SamplingParams

torch = pytest.importorskip("torch")
PROMPT = "Once upon a time"


def _session(tiny: str, config: ExecutorConfig, device: str = "cpu") -> tuple[list[int], dict[str, int]]:
    """A fresh session's greedy tokens and what Inductor did for it (counter deltas)."""
    from torch._dynamo.utils import counters

    from apir.backends.local import LocalBackend

    torch._dynamo.reset()
    before = dict(counters["inductor"])
    with apir.load(tiny, backend=LocalBackend(device, config=config)) as model:
        ids = list(model.generate_ids(model.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=6)))
    return ids, {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on a CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch, on the torn entry
def test_a_second_session_loads_its_compiled_step_and_a_corrupt_one_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # restored after the test
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(n_layer=1, context_length=64), seed=3))
    with apir.load(tiny, backend="local", device="cpu") as eager:
        expected = list(eager.generate_ids(eager.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=6)))
    cache = tmp_path / "compiled"
    config = ExecutorConfig(compile_cpu=True, compile_cache=str(cache))

    ids, did = _session(tiny, config)
    assert ids == expected
    assert did == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}  # compiled, once
    (versioned,) = cache.iterdir()
    assert versioned.name.startswith(f"torch-{torch.__version__}-apir-")
    assert versioned.stat().st_mode & 0o077 == 0  # the host's own: no other user reads or plants files

    ids, did = _session(tiny, config)
    assert ids == expected
    assert did == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}  # loaded, not compiled

    entries = [p for p in versioned.rglob("*") if p.is_file() and {"fxgraph", "aotautograd"} & set(p.parts)]
    assert entries
    for p in entries:  # cut short, as a full disk or a torn copy would leave them
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    ids, did = _session(tiny, config)
    assert ids == expected
    assert did == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}  # compiled again, not loaded
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(versioned)
    assert Path(versioned).is_dir()


@pytest.mark.gpu
def test_a_second_cuda_session_loads_its_compiled_decode_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(context_length=512), "F16", seed=3))
    config = ExecutorConfig(compile_cache=str(tmp_path / "compiled"))  # CUDA: compile="decode"
    first, did = _session(tiny, config, "cuda")
    assert did["fxgraph_cache_miss"] >= 1 and did["fxgraph_cache_hit"] == 0
    second, did = _session(tiny, config, "cuda")
    assert did["fxgraph_cache_hit"] >= 1 and did["fxgraph_cache_miss"] == 0
    assert second == first
