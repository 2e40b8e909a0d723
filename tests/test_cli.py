"""The apir command: results on stdout, one clear line on stderr for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
from tiny_models import TinyConfig, write_tiny_gguf

from apir.models.resolve import resolve_model


def apir(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apir.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", TinyConfig(context_length=64))


def test_missing_file(tmp_path):
    line = one_error_line(apir("run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"))
    assert line == f"error: model file not found: {tmp_path / 'nope.gguf'}"


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("these are not weights")
    line = one_error_line(apir("run", "-m", str(bad), "-p", "hi"))
    assert "is not a GGUF file" in line


def test_truncated_gguf(tmp_path, tiny):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    line = one_error_line(apir("run", "-m", str(cut), "-p", "hi"))
    assert "truncated" in line or "corrupt" in line


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = one_error_line(apir("run", "-m", str(path), "-p", "hi"))
    assert "unsupported architecture 'bert'" in line
    assert "llama" in line and "gemma3" in line  # lists what is supported


def test_prompt_longer_than_context(tiny):
    line = one_error_line(apir("run", "-m", str(tiny), "-p", "x" * 200, "--backend", "numpy"))
    assert "context holds 64" in line


def test_unknown_model_name():
    line = one_error_line(apir("run", "-m", "no-such-model", "-p", "hi"))
    assert "unknown model 'no-such-model'" in line and "smollm2-135m" in line


def test_bad_sampling_option(tiny):
    line = one_error_line(apir("run", "-m", str(tiny), "-p", "hi", "--top-p", "0"))
    assert "top_p" in line


def test_tokenize_prints_json_ids():
    try:
        resolve_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    out = apir("tokenize", "Hello, world!")
    assert out.returncode == 0
    assert json.loads(out.stdout) == [19556, 28, 905, 17]  # llama.cpp's ids (fixtures)


def test_info_reports_the_model(tiny):
    out = apir("info", "-m", str(tiny), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "llama"
    assert info["context_length"] == 64
    assert info["quantization"] == "F16"
    assert info["parameters"] > 0


def test_one_shot_stdout_is_only_the_generated_text(tiny):
    import apir as api

    out = apir("run", "-m", str(tiny), "-p", "Hello", "-n", "6", "--temp", "0", "--backend", "numpy")
    assert out.returncode == 0, out.stderr
    with api.load(str(tiny), backend="numpy") as model:
        assert out.stdout == model.generate("Hello", temperature=0, max_tokens=6) + "\n"
    assert "generated" in out.stderr


def test_interactive_chat_reads_stdin(tiny):
    out = apir("run", "-m", str(tiny), "-n", "4", "--temp", "0", "--backend", "numpy",
               input="Hi there\n\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("> ")


def test_run_finds_a_model_registered_by_pull(tiny, tmp_path):
    """`apir pull FILE` registers it under its stem; run, info and tokenize find that name
    the way serve and bench do (one resolver)."""
    import os

    env = {**os.environ, "APIR_CACHE_DIR": str(tmp_path / "cache")}
    mine = tmp_path / "my-tiny.gguf"
    mine.write_bytes(tiny.read_bytes())
    assert apir("pull", str(mine), env=env).returncode == 0
    by_name = apir("run", "-m", "my-tiny", "-p", "Hello", "-n", "5", "--temp", "0", "--backend", "numpy", env=env)
    assert by_name.returncode == 0, by_name.stderr
    by_path = apir("run", "-m", str(mine), "-p", "Hello", "-n", "5", "--temp", "0", "--backend", "numpy")
    assert by_name.stdout == by_path.stdout and "loaded my-tiny.gguf" in by_name.stderr
    info = apir("info", "-m", "my-tiny", "--json", env=env)
    assert info.returncode == 0 and json.loads(info.stdout)["path"] == str(mine)
    assert "unknown model 'my-tiny'" in one_error_line(apir("run", "-m", "my-tiny", "-p", "hi"))


def _import_graph() -> dict[str, set[str]]:
    """apir's modules and the apir modules each imports, at the top or inside a function
    (the package root left out: importing any submodule imports it first anyway)."""
    import ast
    from pathlib import Path

    import apir as api

    root = Path(api.__file__).parent
    paths = {".".join(("apir", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                deps |= {f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names}
        graph[name] = {d for d in deps if d in paths and d not in (name, "apir")}
    return graph


def test_no_import_circle():
    graph, done, path = _import_graph(), set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    assert {"apir.flags", "apir.doctor"} <= graph["apir.cli"] and "apir.flags" in graph["apir.server.cli"]
    for module in graph:
        visit(module)


@pytest.mark.parametrize("module", ["apir.cli", "apir.doctor", "apir.server.cli", "apir.spawn"])
def test_each_command_module_imports_alone(module):
    out = subprocess.run([sys.executable, "-c", f"import {module}; import sys; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # and none of them drags torch in


def test_a_daemon_that_cannot_start_is_one_error_naming_why(tmp_path):
    from apir.errors import ApirError
    from apir.spawn import start_host

    with pytest.raises(ApirError) as e:
        start_host([f"unix://{tmp_path / 'apir.sock'}"], tmp_path / "host.log", options=("--max-sessions", "many"))
    assert str(e.value).startswith("the apir host exited with status 2 before it answered: ")
    assert "invalid int value: 'many'" in str(e.value)


def test_ctx_size_beyond_the_model_or_zero_is_an_error_before_loading(tiny):
    over = apir("run", "-m", str(tiny), "-p", "hi", "-c", "65", "--backend", "numpy")
    line = one_error_line(over)
    assert line == "error: a context of 65 tokens was asked for (--ctx-size); this model's holds 1 to 64"
    assert "loaded" not in over.stderr
    assert one_error_line(apir("run", "-m", str(tiny), "-p", "hi", "-c", "0")) == \
        "error: --ctx-size must be >= 1, got 0"
    import os

    bad = apir("run", "-m", str(tiny), "-p", "hi", env={**os.environ, "APIR_CTX_SIZE": "lots"})
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.endswith("error: argument -c/--ctx-size: invalid int value: 'lots'\n")


def test_the_overflow_message_advises_raising_only_what_can_be_raised(tiny):
    whole = one_error_line(apir("run", "-m", str(tiny), "-p", "x" * 200, "-c", "64", "--backend", "numpy"))
    assert whole.endswith("but the context holds 64; the model's whole context: shorten it")
    part = one_error_line(apir("run", "-m", str(tiny), "-p", "x" * 40, "-c", "32", "--backend", "numpy"))
    assert part.endswith("but the context holds 32; shorten it or raise --ctx-size (up to 64)")


def test_n_minus_one_generates_until_the_context_is_full(tiny):
    import apir as api
    from apir.engine import SamplingParams

    out = apir("run", "-m", str(tiny), "-p", "Hello", "-n", "-1", "--temp", "0", "--backend", "numpy")
    assert out.returncode == 0, out.stderr
    with api.load(str(tiny), backend="numpy") as model:
        room = 64 - len(model.tokenize("Hello"))
        ids = list(model.generate_ids(model.tokenize("Hello"), SamplingParams(temperature=0, max_tokens=room)))
        assert out.stdout == model.detokenize(ids) + "\n"
    assert f"generated {len(ids)} tokens" in out.stderr
    assert one_error_line(apir("run", "-m", str(tiny), "-p", "hi", "-n", "-2")) == \
        "error: -n must be -1 (until the context is full) or >= 0, got -2"


def test_help_shows_the_defaults_of_n_and_threads():
    from apir import env

    out = apir("run", "--help")
    assert "(default: 256; -1: until the context is full)" in " ".join(out.stdout.split())
    assert f"(default: {env.default_threads()} here," in " ".join(out.stdout.split())


def test_a_prompt_from_a_file_is_the_prompt_of_p(tiny, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello\n")  # one trailing newline dropped, as llama.cpp's -f does
    by_file = apir("run", "-m", str(tiny), "-f", str(prompt), "-n", "6", "--temp", "0", "--backend", "numpy")
    by_flag = apir("run", "-m", str(tiny), "-p", "Hello", "-n", "6", "--temp", "0", "--backend", "numpy")
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == by_flag.stdout and "prompt 6 tokens" in by_file.stderr  # BOS + 5 bytes
    assert one_error_line(apir("run", "-m", str(tiny), "-f", str(tmp_path / "none.txt"))) == \
        f"error: cannot read the prompt file {tmp_path / 'none.txt'}: No such file or directory"


def test_threads_flag_env_and_default_reach_torch(tiny):
    import os

    base = ("run", "-m", str(tiny), "-p", "Hello", "-n", "2", "--backend", "local", "--device", "cpu")
    env = {k: v for k, v in os.environ.items() if k not in ("APIR_THREADS", "OMP_NUM_THREADS")}
    assert "on local:cpu (1 CPU thread)" in apir(*base, "-t", "1", env={**env, "APIR_THREADS": "2"}).stderr
    assert "on local:cpu (2 CPU threads)" in apir(*base, env={**env, "APIR_THREADS": "2"}).stderr
    out = apir(*base, "--threads", "0")
    assert out.returncode == 2 and "argument -t/--threads: must be >= 1, got 0" in out.stderr


def test_each_session_worker_computes_with_the_hosts_threads(tmp_path):
    """The daemon sets -t once; every session's worker, forked from it, computes with them:
    a worker of ``-t 2`` runs more threads (OpenMP's) than one of ``-t 1``."""
    import os

    from hosts import start_host

    import apir as api

    # big enough for torch to parallelise its matmuls at all
    model_file = write_tiny_gguf(tmp_path / "wide.gguf", TinyConfig(n_embd=256, n_ff=1024, head_dim=64))
    tasks = {}
    for n in (1, 2):
        (tmp_path / str(n)).mkdir()
        host = start_host(tmp_path / str(n), "-t", str(n))
        try:
            assert f"apir host: sessions compute with {n} CPU thread" in host.log.read_text()
            with api.load(str(model_file), backend="remote", remote=host.unix) as model:
                model.generate("Hello world " * 8, temperature=0, max_tokens=4)
                worker = host.status().sessions[0].pid
                tasks[n] = len(os.listdir(f"/proc/{worker}/task"))
        finally:
            host.stop()
    assert tasks[2] > tasks[1], tasks


def test_host_device_cuda_without_cuda_refuses_to_start(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = apir("host", "--device", "cuda", "--listen", f"unix://{tmp_path / 'h.sock'}")
    line = one_error_line(out)
    assert line.startswith("error: apir host --device cuda: torch ") and "use --device cpu" in line
    assert not (tmp_path / "h.sock").exists()


def test_serve_on_a_port_in_use_is_one_line_before_loading(tiny):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = apir("serve", "-m", str(tiny), "--backend", "numpy", "--port", str(port))
    assert out.returncode == 1
    assert out.stderr == f"error: apir serve cannot listen on 127.0.0.1:{port}: Address already in use\n"
