"""Compiled steps outlive the session (``ExecutorConfig.compile_cache``): a second session
with the same graph loads its compiled decode step from the host's step store instead of
tracing and compiling it (``inductor.STATS`` says which happened), a model whose graph
differs in anything (here: only its RoPE base) never loads another's step, one whose
buffers have other handles (a remote guest's are not a native process's) does, a corrupt entry
is compiled again, not trusted, and tokens are those of an eager run throughout.

On the CPU this needs ``compile_cpu`` (Inductor's C++ build, gcc); the CUDA path, where
decode steps compile by default, has its own test (marked gpu). A "session" here is a
backend in this process: what it finds is the directory, as a new worker process would."""

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


def _session(tiny: str, config: ExecutorConfig, device: str = "cpu",
             taken: int = 0) -> tuple[list[int], dict[str, int]]:
    """A fresh session's greedy tokens and what its compiled steps did (counter deltas);
    ``taken`` buffers allocated first, so that the model's have other handles."""
    from apir.backends.local import LocalBackend, inductor

    before = dict(inductor.STATS)
    backend = LocalBackend(device, config=config)
    for _ in range(taken):
        backend.alloc_buffer(64)
    with apir.load(tiny, backend=backend) as model:
        ids = list(model.generate_ids(model.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=6)))
    return ids, {k: inductor.STATS[k] - before.get(k, 0) for k in ("compiled", "loaded", "saved")}


def _eager(tiny: str) -> list[int]:
    with apir.load(tiny, backend="local", device="cpu") as eager:
        return list(eager.generate_ids(eager.tokenize(PROMPT), SamplingParams(temperature=0, max_tokens=6)))


COMPILED, LOADED = {"compiled": 1, "loaded": 0, "saved": 1}, {"compiled": 0, "loaded": 1, "saved": 0}


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on a CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch, on the torn entry
def test_a_second_session_loads_its_compiled_step_and_a_corrupt_one_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # restored after the test
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(n_layer=1, context_length=64), seed=3))
    expected = _eager(tiny)
    cache = tmp_path / "compiled"
    config = ExecutorConfig(compile_cpu=True, compile_cache=str(cache))

    assert _session(tiny, config) == (expected, COMPILED)
    (versioned,) = cache.iterdir()
    assert versioned.name.startswith(f"torch-{torch.__version__}-apir-")
    assert versioned.stat().st_mode & 0o077 == 0  # the host's own: no other user reads or plants files
    (step,) = (versioned / "steps").iterdir()

    assert _session(tiny, config) == (expected, LOADED)  # neither traced nor compiled
    # buffers numbered otherwise (a remote guest's are not a native process's): the same step
    assert _session(tiny, config, taken=3) == (expected, LOADED)

    # another model of the very same shapes, weights and vocabulary, whose graph differs
    # in one attribute: its own step, compiled (loading the first one's would be wrong)
    other = str(write_tiny_gguf(tmp_path / "other.gguf", TinyConfig(n_layer=1, context_length=64, rope_base=500.0),
                                seed=3))
    assert _session(other, config) == (_eager(other), COMPILED)
    assert len(list((versioned / "steps").iterdir())) == 2

    data = step.read_bytes()
    step.write_bytes(data[: len(data) // 2])  # cut short, as a full disk or a torn copy would leave it
    assert _session(tiny, config) == (expected, COMPILED)  # compiled again (and saved whole), not loaded
    assert _session(tiny, config) == (expected, LOADED)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(versioned)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on a CPU needs a C++ compiler")
def test_a_batched_decode_step_is_compiled_and_gives_the_eager_tokens(tmp_path, monkeypatch):
    """A batched graph's decode step (one sampled token for each of its B sequences) is a
    decode step: compiled once per B, as a one-sequence decode is (on a GPU, where every
    step of a batch is recorded, this is what fuses its elementwise kernels); a step with a
    prompt chunk is not. Tokens are the eager ones."""
    from apir.backends.local import LocalBackend, inductor
    from apir.engine.batch import Batch, Chunk
    from apir.graph.sampling import GREEDY

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(n_layer=1, context_length=64), seed=3))

    def tokens(config: ExecutorConfig) -> list[list[int]]:
        with apir.load(tiny, backend=LocalBackend("cpu", config=config)) as model:
            batch = Batch(model, slots=2)
            out = [batch.step([Chunk(0, [5, 6, 7], 0, GREEDY), Chunk(1, [9], 0, GREEDY)])]  # a prompt step
            for i in range(3):  # decode steps of both sequences
                out.append(batch.step([Chunk(s, [out[-1][s]], 3 - 2 * s + i, GREEDY) for s in range(2)]))
            return out

    expected = tokens(ExecutorConfig())
    before = inductor.STATS["compiled"]
    assert tokens(ExecutorConfig(compile_cpu=True, compile_cache=str(tmp_path / "compiled"))) == expected
    assert inductor.STATS["compiled"] - before == 1  # the 2-sequence decode step, once


@pytest.mark.gpu
def test_a_second_cuda_session_loads_its_compiled_decode_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(context_length=512), "F16", seed=3))
    config = ExecutorConfig(compile_cache=str(tmp_path / "compiled"))  # CUDA: compile="decode"
    first, did = _session(tiny, config, "cuda")
    assert did["compiled"] >= 1 and did["loaded"] == 0
    second, did = _session(tiny, config, "cuda")
    assert did["loaded"] >= 1 and did["compiled"] == 0
    assert second == first


class FakeArtifact:
    """A compiled step's interface for saving: ``size`` bytes."""

    def __init__(self, size: int) -> None:
        self.size = size

    def save(self, *, path: str, format: str) -> None:
        Path(path).write_bytes(b"x" * self.size)


def test_the_step_store_keeps_to_its_size_dropping_the_least_recently_used(tmp_path):
    from apir.backends.local.inductor import StepStore

    store = StepStore(tmp_path / "steps", max_bytes=2500)
    for i, digest in enumerate("abc"):
        store.save(digest, FakeArtifact(1000))
        os.utime(store.path(digest), (1000 + i, 1000 + i))  # a, b, c saved in that order
    assert sorted(p.stem for p in (tmp_path / "steps").iterdir()) == ["b", "c"]  # a went: 3000 > 2500
    os.utime(store.path("b"), (2000, 2000))  # b used since (a load touches its file)
    store.save("d", FakeArtifact(1000))
    assert sorted(p.stem for p in (tmp_path / "steps").iterdir()) == ["b", "d"]
    store.save("e", FakeArtifact(4000))  # alone over the size: kept, every other one goes
    assert sorted(p.stem for p in (tmp_path / "steps").iterdir()) == ["e"]
    assert not list((tmp_path / "steps").glob("*.part"))
