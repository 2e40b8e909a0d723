"""A compile the host must do is announced on the guest's stderr, once per compile, and
short prompts (2..8 tokens) never compile. CI has no GPU, so the host's CUDA path is run
on the CPU: a worker serves a real guest from a thread, its LocalBackend takes the
compile path with the compiler as the identity and the CUDA graph run eagerly."""

from __future__ import annotations

import os
import shutil
import socket

import numpy as np
import pytest
import torch
from tiny_models import TinyConfig, write_tiny_gguf

import apir
import apir.backends.local as local_pkg
from apir.backends import local
from apir.backends.base import DEFAULT_EXECUTOR, NO_LIMITS, ExecutorConfig
from apir.backends.local import executor
from apir.engine import SamplingParams
from apir.graph import DType, GraphBuilder, T
from apir.host.session import SessionConfig
from apir.host.worker import run_worker
from apir.transport import Connection

LINE = "host compiling decode graph (greedy step, first use of this model on this host)…"


class EagerStep:
    """CapturedStep's interface, run eagerly (no CUDA here)."""

    def __init__(self, run, inputs, dtypes, device, versions) -> None:
        self.run, self.versions = run, versions

    def __call__(self, inputs):
        return self.run({n: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.array(a))
                         for n, a in inputs.items()})


class UncompiledStep:
    """inductor.Compiled's interface, the compiler being the identity: announced on the
    first call, as a compile with nothing in the store is."""

    def __init__(self, run, store, description, announce) -> None:
        self.run, self.announce, self.called = run, announce, False

    def __call__(self, *args):
        if not self.called:
            self.called = True
            self.announce()
        return self.run(*args)


class CompilingBackend(local.LocalBackend):
    """The CUDA path's decisions (capture, compile) on the CPU."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuda_graphs = self.compile = True


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setattr(local_pkg, "LocalBackend", CompilingBackend)
    monkeypatch.setattr(executor, "CapturedStep", EagerStep)
    monkeypatch.setattr(executor.inductor, "Compiled", UncompiledStep)
    program = executor.compile_program  # the GPU's program: host-checked indices, device kernels
    monkeypatch.setattr(executor, "compile_program", lambda graph, _, dtype: program(graph, True, dtype))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinyConfig(context_length=256), seed=9))


def serve_one(path: str, executor_config: ExecutorConfig = DEFAULT_EXECUTOR) -> int:
    """A host worker for one guest on ``path``, forked from this process (with its
    patches); returns its pid."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    pid = os.fork()
    if pid:
        listener.close()
        return pid
    code = 0
    try:  # the worker: never returns into pytest
        # the parent's OpenMP threads are not in this child: one parallel fill (the
        # worker's zeroed buffers) would wait for them forever
        torch.set_num_threads(1)
        sock, _ = listener.accept()
        listener.close()
        conn = Connection.over(sock, "test")
        hello = conn.channel.recv().message
        run_worker(conn, hello, SessionConfig("cpu", NO_LIMITS, 1 << 26, 1, "test", executor=executor_config),
                   lambda *_: None)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


@pytest.mark.parametrize("prompt", ["Hi", "Once upon a time, far away"])
def test_compile_is_announced_once_and_short_prompts_do_not_compile(compiling, tiny, tmp_path, capsys, prompt):
    params = SamplingParams(temperature=0, max_tokens=8)
    with apir.load(tiny, backend="local", device="cpu") as ref:
        ids = ref.tokenize(prompt)
        want = list(ref.generate_ids(ids, params))
    assert (2 <= len(ids) <= 8) == (prompt == "Hi")
    pid = serve_one(str(tmp_path / "s.sock"))
    with apir.load(tiny, backend="remote", remote=f"unix://{tmp_path / 's.sock'}") as model:
        assert list(model.generate_ids(ids, params)) == want
        assert list(model.generate_ids(ids, params)) == want  # compiled once: no second line
    assert os.waitpid(pid, 0)[1] == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("host ")]
    assert lines == [LINE]  # the decode step; the prompt's step (any length) is not compiled


def test_compile_modes_pick_the_lengths(compiling):
    """decode: only one-token steps compile; all: padded prefill chunks too, never 2..8."""
    for mode, compiled in [("decode", ["decode"]), ("all", ["decode", "16-token prefill"]), ("off", [])]:
        be = CompilingBackend("cpu", config=ExecutorConfig(compile=mode))
        be.compile = mode != "off"
        told: list[str] = []
        be.on_compile = told.append
        g = GraphBuilder()
        x = g.input("x", (T, 4), DType.F32)
        gid = be.register_graph(g.build(g.add(x, x)))
        for n in (1, 2, 5, 8, 16):
            (out,) = be.compute(gid, {"x": np.ones((n, 4), np.float32)})
            np.testing.assert_array_equal(out, np.full((n, 4), 2, np.float32))
        assert [t.removeprefix("compiling ").split(" graph")[0] for t in told] == compiled, (mode, told)
        be.close()


class WarmingStep(EagerStep):
    """EagerStep that runs its step once when made, as CapturedStep's warm-up does: where
    a compile failure surfaces."""

    def __init__(self, run, inputs, dtypes, device, versions) -> None:
        super().__init__(run, inputs, dtypes, device, versions)
        self(inputs)


def test_a_step_that_fails_to_compile_runs_eagerly_and_the_others_still_compile(compiling, monkeypatch):
    monkeypatch.setattr(executor, "CapturedStep", WarmingStep)
    be = CompilingBackend("cpu", config=ExecutorConfig(compile="all"))
    tried: list[int] = []

    def compiled(reg, n_tokens, greedy):
        tried.append(n_tokens)
        if n_tokens == 16:
            def broken(*args):
                raise TypeError("list indices must be integers or slices, not NoneType")
            return broken
        return be._execute

    be._compiled = compiled
    g = GraphBuilder()
    x = g.input("x", (T, 4), DType.F32)
    gid = be.register_graph(g.build(g.add(x, x)))
    for n in (16, 1, 16):
        (out,) = be.compute(gid, {"x": np.ones((n, 4), np.float32)})
        np.testing.assert_array_equal(out, np.full((n, 4), 2, np.float32))
    assert tried == [16, 1]  # the decode step compiled after the prefill's failure
    assert be._uncompiled == {(16, False)}
    be.close()


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor on a CPU needs a C++ compiler")
def test_a_later_session_on_the_host_loads_the_step_an_earlier_one_compiled(tmp_path, capsys):
    """Two guest sessions of one model, each its own worker process (as the daemon forks
    them), on a host that compiles its decode step (a CPU with compile_cpu): the first
    is told of the compile, the second is not (its worker loads the step from the store),
    and both compute eager's tokens."""
    tiny = str(write_tiny_gguf(tmp_path / "one.gguf", TinyConfig(n_layer=1, context_length=64), seed=4))
    params = SamplingParams(temperature=0, max_tokens=6)
    with apir.load(tiny, backend="local", device="cpu") as ref:
        ids = ref.tokenize("Once upon")
        want = list(ref.generate_ids(ids, params))
    config = ExecutorConfig(compile_cpu=True, compile_cache=str(tmp_path / "compiled"))
    told = []
    for i in range(2):
        sock = str(tmp_path / f"s{i}.sock")
        pid = serve_one(sock, config)
        with apir.load(tiny, backend="remote", remote=f"unix://{sock}") as model:
            assert list(model.generate_ids(ids, params)) == want
        assert os.waitpid(pid, 0)[1] == 0
        told.append([ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("host ")])
    assert told == [[LINE], []]
    (versioned,) = (tmp_path / "compiled").iterdir()
    assert len(list((versioned / "steps").glob("*.step"))) == 1
