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
