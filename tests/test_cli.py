"""The apir command: results on stdout, one clear line on stderr for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
from tiny_models import TinyConfig, write_tiny_gguf

from apir.models.resolve import resolve_model


def apir(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apir.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


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
