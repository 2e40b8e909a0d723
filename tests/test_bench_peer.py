"""The peer run against llama.cpp (issue 18): synthetic models written as GGUF files,
``apir bench -d DEPTH``, ``apir bench peer`` on llama-bench's JSON, and the argument
handling and flow of ``scripts/bench-llamacpp.sh`` (with a stand-in llama-bench: building
llama.cpp is for a GPU host, not CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from apir.backends import create_backend
from apir.bench.errors import BenchError, BenchInputError
from apir.bench.gguf_out import vocabulary, write_all, write_gguf
from apir.bench.peer import llama_test_name, load_llama_bench, pair, render
from apir.bench.runner import BenchConfig, Source
from apir.bench.synthetic import SyntheticFile
from apir.cli import main
from apir.engine.model import Model
from apir.models.gguf_file import GGUFFile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench-llamacpp.sh"
KT = gguf.Keys.Tokenizer


# ---------------------------------------------------------------- GGUF files of the synthetic models


@pytest.mark.parametrize("spec", ["llama-tiny:q4_k", "llama-tiny:f16", "llama-tiny:q6_k"])
def test_a_written_gguf_holds_the_synthetic_model_byte_for_byte(tmp_path: Path, spec: str) -> None:
    synthetic = SyntheticFile.from_spec(spec)
    f = GGUFFile(write_gguf(synthetic, tmp_path / "m.gguf"))
    assert list(f.tensors) == list(synthetic.tensors)
    for name, want in synthetic.tensors.items():
        got = f.tensor(name)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        np.testing.assert_array_equal(got.data, want.data, err_msg=name)
    for key, value in synthetic.metadata.items():
        assert f.get(key) == pytest.approx(value), key
    assert not list(tmp_path.glob(".*.part"))  # the temporary file was renamed


def test_the_vocabulary_is_what_llama_cpp_reads(tmp_path: Path) -> None:
    """llama.cpp's SPM vocab: tokens, f32 scores and i32 types of one length; <unk> <s> </s>
    first; the 256 byte tokens (it looks up <0x0A> for the newline)."""
    f = GGUFFile(write_gguf(SyntheticFile.from_spec("llama-tiny:q4_0"), tmp_path / "m.gguf"))
    tokens = f.get(KT.LIST)
    assert f.get(KT.MODEL) == "llama" and len(tokens) == 512 == f.get("llama.vocab_size")
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"
    assert len(set(tokens)) == 512
    assert f.value_types[KT.TOKEN_TYPE] == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    assert f.value_types[KT.SCORES] == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    assert list(f.get(KT.TOKEN_TYPE)[:5]) == [2, 3, 3, 6, 6] and len(f.get(KT.SCORES)) == 512
    assert (f.get(KT.BOS_ID), f.get(KT.EOS_ID), f.get(KT.UNK_ID)) == (1, 2, 0)
    assert f.get(gguf.Keys.General.FILE_TYPE) == gguf.LlamaFileType.MOSTLY_Q4_0
    with pytest.raises(BenchError, match="256 byte tokens"):
        vocabulary(100)


def test_a_written_gguf_computes_the_same_tokens_and_has_a_tokenizer(tmp_path: Path) -> None:
    (path,) = write_all(["llama-tiny:q4_0"], tmp_path, lambda line: None)
    assert path.name == "llama-tiny-q4_0.gguf"
    prompt = [1, 300, 17, 4, 499, 258]
    runs = []
    for source in (SyntheticFile.from_spec("llama-tiny:q4_0"), GGUFFile(path)):
        model = Model(source, create_backend("numpy"), n_ctx=32)
        first = model.prefill(prompt)
        runs.append([first, *model.decode_steps(first, len(prompt), 5)])
    assert runs[0] == runs[1]
    ids = model.tokenize("hi\n")  # <s>, then every character as its byte tokens
    assert ids[0] == 1 and len(ids) == 1 + 3 + 3 and model.detokenize(ids[1:]) == "▁hi\n"


def test_write_gguf_through_the_cli(capsys, tmp_path: Path) -> None:
    out = tmp_path / "models"
    assert main(["bench", "--write-gguf", str(out), "--synthetic", "llama-tiny:q8_0,llama-tiny:f16"]) == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["llama-tiny-f16.gguf", "llama-tiny-q8_0.gguf"]
    assert f"wrote {out / 'llama-tiny-q8_0.gguf'}" in err
    assert main(["bench", "--write-gguf", str(out)]) == 1
    assert "--write-gguf writes the --synthetic models" in capsys.readouterr().err
    assert main(["bench", "--write-gguf", str(out), "--synthetic", "llama-tiny:q3_k"]) == 1
    assert "unknown weight type 'q3_k'" in capsys.readouterr().err


# ---------------------------------------------------------------- -d DEPTH


def test_depth_tests_and_the_context_they_need() -> None:
    config = BenchConfig((Source("llama-tiny", True),), ("guest-cpu",), (16,), (8,), (0, 32))
    assert [t.name for t in config.tests] == ["pp16", "tg8", "pp16@d32", "tg8@d32"]
    assert [t.start for t in config.tests] == [0, 4, 32, 32]  # tg at depth 0 after 4 tokens
    assert config.n_ctx == 48
    with pytest.raises(BenchError, match="-d take token counts"):
        BenchConfig((Source("llama-tiny", True),), ("guest-cpu",), n_depth=(-1,))


def test_prefill_at_a_depth_continues_the_cache() -> None:
    """What pp at depth D times: the next chunk at positions D.., after D cached tokens."""
    model = Model(SyntheticFile.from_spec("llama-tiny:f16"), create_backend("numpy"), n_ctx=32)
    ids = [5, 77, 300, 2, 9, 41, 8, 123, 64, 1]
    whole = model.prefill(ids)
    model.prefill([400, 401, 402])  # other rows at 0..2, overwritten next
    model.prefill(ids[:6])
    assert model.prefill(ids[6:], start=6) == whole


def test_bench_on_a_written_file_at_depth_records_n_depth(capsys, tmp_path: Path) -> None:
    (path,) = write_all(["llama-tiny:q4_0"], tmp_path, lambda line: None)
    code = main(["bench", "-m", str(path), "-p", "8", "-n", "4", "-d", "0,16", "-r", "1",
                 "--backends", "guest-cpu", "-o", "json", "--no-history"])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = json.loads(out)
    assert [(r["model"], r["test"], r["n_depth"]) for r in records] == [
        ("llama-tiny-q4_0.gguf", "pp8", 0), ("llama-tiny-q4_0.gguf", "tg4", 0),
        ("llama-tiny-q4_0.gguf", "pp8@d16", 16), ("llama-tiny-q4_0.gguf", "tg4@d16", 16)]
    assert {r["n_ctx"] for r in records} == {24} and {r["kv_type"] for r in records} == {"f16"}


# ---------------------------------------------------------------- llama-bench's JSON


def llama_bench_record(model: str, n_prompt: int, n_gen: int, n_depth: int, avg_ts: float) -> dict:
    """One record as `llama-bench -o json` writes it (every field of its test::get_fields)."""
    return {
        "build_commit": "b7f3c1e", "build_number": 7012, "cpu_info": "AMD EPYC 9654",
        "gpu_info": "NVIDIA H200", "backends": "CUDA", "model_filename": model,
        "model_type": "llama 8B Q4_0", "model_size": 4_653_375_488, "model_n_params": 8_030_261_248,
        "n_batch": 2048, "n_ubatch": 512, "n_threads": 16, "cpu_mask": "0x0", "cpu_strict": False,
        "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "n_cpu_moe": 0,
        "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": 1,
        "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none",
        "load_mode": "mmap", "lazy_mode": "none", "embeddings": False, "no_op_offload": 0,
        "no_host": False, "repack": True, "fit_target": 0, "fit_min_ctx": 0,
        "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
        "test_time": "2026-12-01T16:00:00Z", "avg_ns": round(1e9 * (n_prompt + n_gen) / avg_ts),
        "stddev_ns": 1000, "avg_ts": avg_ts, "stddev_ts": 1.5,
        "samples_ns": [1, 2], "samples_ts": [avg_ts, avg_ts],
    }


def write_llama_bench_json(path: Path, records: list[dict]) -> Path:
    """The file as llama-bench's json_printer lays it out: `[`, records, `]`."""
    body = ",\n".join("  {\n" + ",\n".join(f'    "{k}": {json.dumps(v)}' for k, v in r.items()) + "\n  }"
                      for r in records)
    path.write_text("[\n" + body + "\n]\n")
    return path


def apir_record(model: str, test: str, backend: str, avg_ts: float) -> dict:
    return {"model": model, "backend": backend, "test": test, "avg_ts": avg_ts,
            "gpu_memory": {"allocated": 4_700_000_000, "peak": 5_000_000_000}}


def test_llama_bench_records_are_named_as_apir_names_its_tests(tmp_path: Path) -> None:
    path = write_llama_bench_json(tmp_path / "l.json", [
        llama_bench_record("/tmp/apir-llamacpp/gguf/llama-8b-q4_0.gguf", 512, 0, 0, 10600.0),
        llama_bench_record("/tmp/apir-llamacpp/gguf/llama-8b-q4_0.gguf", 0, 128, 0, 346.0),
        llama_bench_record("/tmp/apir-llamacpp/gguf/llama-8b-q4_0.gguf", 0, 128, 4096, 300.0),
    ])
    records = load_llama_bench(path)
    assert [(r["model"], r["test"]) for r in records] == [
        ("llama-8b-q4_0.gguf", "pp512"), ("llama-8b-q4_0.gguf", "tg128"),
        ("llama-8b-q4_0.gguf", "tg128@d4096")]
    assert llama_test_name(512, 128, 0) == "pp512+tg128"
    rows = pair(records, [apir_record("llama-8b-q4_0.gguf", "tg128", "native", 519.0),
                          apir_record("llama-8b-q4_0.gguf", "tg128@d4096", "native", 420.0),
                          apir_record("llama-8b-q4_0.gguf", "pp256", "native", 1.0),  # no peer
                          apir_record("other.gguf", "tg128", "native", 1.0)])
    assert [(r.test, round(r.ratio, 3)) for r in rows] == [("tg128", 1.5), ("tg128@d4096", 1.4)]
    table = render(rows)
    assert "| llama-8b-q4_0.gguf | tg128 " in table and "1.500" in table
    assert "4.38 GiB (1.01x), peak 4.66 GiB" in table  # apir's bytes against the GGUF's tensors


def test_apir_bench_peer_prints_the_ratios(capsys, tmp_path: Path) -> None:
    llama = write_llama_bench_json(tmp_path / "llama.json", [
        llama_bench_record("m/llama-1b-q4_0.gguf", 512, 0, 0, 45400.0),
        llama_bench_record("m/llama-1b-q4_0.gguf", 0, 128, 0, 1098.0)])
    ours = tmp_path / "apir.json"
    ours.write_text(json.dumps([apir_record("llama-1b-q4_0.gguf", "pp512", "native", 81200.0),
                                apir_record("llama-1b-q4_0.gguf", "tg128", "remote-shm", 1010.0)]))
    assert main(["bench", "peer", "--llamacpp", str(llama), "--apir", str(ours)]) == 0
    out = capsys.readouterr().out
    assert "apir ÷ llama.cpp" in out and "1.789" in out and "0.920" in out


@pytest.mark.parametrize(("text", "error"), [
    ("not json", "is not llama-bench JSON"),
    ("[]", "holds no llama-bench records"),
    ('[{"model_filename": "m.gguf", "n_prompt": 512}]', "record 1 is not a llama-bench record (needs "
                                                         "model_filename, n_prompt, n_gen, avg_ts)"),
])
def test_bad_llama_bench_files_are_one_line_errors(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "l.json"
    path.write_text(text)
    with pytest.raises(BenchInputError, match=error.replace("(", r"\(").replace(")", r"\)")):
        load_llama_bench(path)


def test_peer_without_common_tests_names_both_sides(capsys, tmp_path: Path) -> None:
    llama = write_llama_bench_json(tmp_path / "l.json", [llama_bench_record("a.gguf", 512, 0, 0, 1.0)])
    ours = tmp_path / "apir.json"
    ours.write_text(json.dumps([apir_record("b.gguf", "pp512", "native", 1.0)]))
    assert main(["bench", "peer", "--llamacpp", str(llama), "--apir", str(ours)]) == 2
    assert "share no (model file, test): llama.cpp has a.gguf pp512; apir has b.gguf pp512" in (
        capsys.readouterr().err)


# ---------------------------------------------------------------- scripts/bench-llamacpp.sh


def script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_script_help() -> None:
    proc = script("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: scripts/bench-llamacpp.sh")
    assert "--tarball FILE" in proc.stdout and "-d LIST" in proc.stdout


def test_script_without_a_tarball_says_where_it_looked(tmp_path: Path) -> None:
    proc = script("--build", str(tmp_path / "build"), env={"LLAMACPP_TARBALL": str(tmp_path / "none.tgz")})
    assert proc.returncode == 2
    assert proc.stderr == (f"bench-llamacpp: no llama.cpp source tarball at {tmp_path / 'none.tgz'}: "
                           "pass --tarball FILE or set LLAMACPP_TARBALL\n")
    assert not (tmp_path / "build").exists()  # nothing made before the checks


@pytest.mark.parametrize(("args", "error"), [
    (["--frobnicate"], "unknown option --frobnicate (see --help)"),
    (["-d"], "-d needs a value (see --help)"),
    (["--shared-prefix", "100"], "--shared-prefix needs --concurrency"),
    (["--only-serve"], "--only-serve needs --concurrency"),
])
def test_script_bad_arguments(args: list[str], error: str) -> None:
    proc = script(*args)
    assert proc.returncode == 2 and proc.stderr == f"bench-llamacpp: {error}\n"


FAKE_LLAMA_BENCH = r"""#!/usr/bin/env bash
# llama-bench's json output for its -m file: pp8 at 100 t/s, tg4 at 10 t/s
while [ $# -gt 0 ]; do [ "$1" = -m ] && model=$2; shift; done
echo "load_tensors:          CPU model buffer size =     1.25 MiB" >&2
printf '[\n  {"model_filename": "%s", "model_size": 70000, "n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ts": 100.0},\n' "$model"
printf '  {"model_filename": "%s", "model_size": 70000, "n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ts": 10.0}\n]\n' "$model"
"""


def test_script_runs_both_on_each_written_file(tmp_path: Path) -> None:
    """The whole run with a llama.cpp build already there (a stand-in llama-bench): the GGUF
    written, both benches on it, the peer table; the GGUF deleted after its run."""
    bin_dir = tmp_path / "build" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("llama-bench", "llama-batched-bench"):
        (bin_dir / tool).write_text(FAKE_LLAMA_BENCH)
        (bin_dir / tool).chmod(0o755)
    apir = _apir_command(tmp_path)
    out = tmp_path / "out"
    proc = script("--cpu", "--build", str(tmp_path / "build"), "--out", str(out), "-p", "8", "-n", "4",
                  "-r", "1", "--backends", "guest-cpu", "llama-tiny:q4_0",
                  env={"APIR": str(apir), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "reusing the llama.cpp build" in proc.stdout
    assert "llama-tiny-q4_0: llama.cpp CPU model buffer size =     1.25 MiB" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| llama-tiny-q4_0.gguf")]
    assert [line.split("|")[2].strip() for line in rows] == ["pp8", "tg4"]
    assert (out / "peer.md").read_text() in proc.stdout
    assert json.loads((out / "apir-llama-tiny-q4_0.json").read_text())[0]["model"] == "llama-tiny-q4_0.gguf"
    assert not list((tmp_path / "build" / "gguf").iterdir())


FAKE_BATCHED_BENCH = r"""#!/usr/bin/env bash
# llama-batched-bench's table for its -npl list
while [ $# -gt 0 ]; do [ "$1" = -npl ] && npl=$2; shift; done
echo "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
echo "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"
for b in ${npl//,/ }; do echo "|     8 |      4 |  $b |     12 |    0.001 |  8000.00 |    0.010 |   ${b}00.00 |    0.011 |  1000.00 |"; done
"""


def test_script_concurrency_runs_both_batched_benches(tmp_path: Path) -> None:
    """--concurrency --only-serve: llama-batched-bench and apir bench serve on the same
    written file, each table in serve.md under its tool's heading."""
    bin_dir = tmp_path / "build" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool, text in (("llama-bench", FAKE_LLAMA_BENCH), ("llama-batched-bench", FAKE_BATCHED_BENCH)):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "out"
    proc = script("--cpu", "--build", str(tmp_path / "build"), "--out", str(out), "-p", "8", "-n", "4",
                  "--backends", "native", "--concurrency", "1,2", "--only-serve", "--shared-prefix", "24",
                  "llama-tiny:f16", env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                         "APIR": str(_apir_command(tmp_path))})
    assert proc.returncode == 0, proc.stderr
    serve = (out / "serve.md").read_text()
    assert serve.startswith("## llama-tiny-f16: llama-batched-bench\n|    PP |")
    assert "|     8 |      4 |  2 |" in serve
    apir_part = serve.split("## llama-tiny-f16: apir bench serve\n")[1]
    assert [line.split("|")[2].strip() for line in apir_part.splitlines()[2:4]] == ["1", "2"]
    assert "| native | 24 |" in apir_part
    assert not (out / "peer.md").exists()  # --only-serve: no single-stream tests


def _apir_command(tmp_path: Path) -> Path:
    apir = tmp_path / "apir"
    apir.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" -m apir.cli "$@"\n')
    apir.chmod(0o755)
    return apir
