"""``scripts/bench-ab.sh``: one apir bench on another revision's apir package and on this
checkout's, then ``apir bench compare`` of the two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench-ab.sh"


def script(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})


def test_help_says_what_it_takes() -> None:
    proc = script("--help")
    assert proc.returncode == 0
    assert "(--ref REV | --base DIR [--base DIR2 ..])" in proc.stdout and "apir bench compare" in proc.stdout
    assert "runs' logs" in proc.stdout  # the whole header, to its last line


@pytest.mark.parametrize(("args", "error"), [
    ([], "give --ref REV or --base DIR (see --help)"),
    (["--ref", "no-such-revision"], "no such revision here: no-such-revision"),
    (["--ref", "HEAD", "--base", "/tmp"], "give --ref or --base, not both"),
    (["--base", "/"], "/ holds no apir package (apir/__init__.py)"),
    (["--base-only", "/tmp/x"], "--base-only needs --ref (the revision to write)"),
    (["--ref", "HEAD", "--base-only", "/tmp/x", "-p", "8"], "--base-only runs nothing: no --out or bench arguments with it"),
    (["--base", str(ROOT), "--base", str(ROOT)], f"two bases named {ROOT.name}"),
    (["--base", str(ROOT / "tests" / ".." / "."), "--base", "/", "-p", "8"], "/ holds no apir package (apir/__init__.py)"),
])
def test_bad_arguments_are_refused_before_anything_runs(args: list[str], error: str) -> None:
    proc = script(*args)
    assert proc.returncode == 2 and proc.stderr == f"bench-ab: {error}\n"


def test_both_trees_measured_and_compared(tmp_path: Path) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    base = tmp_path / "base"
    proc = script("--ref", "HEAD", "--base-only", str(base))
    assert proc.returncode == 0, proc.stderr
    assert (base / "apir" / "__init__.py").is_file() and not (base / "tests").exists()
    out = tmp_path / "out"
    proc = script("--base", str(base), "--out", str(out), "--", "--synthetic", "llama-tiny:q4_0",
                  "-p", "8", "-n", "4", "-r", "1", "--backends", "native", "--device", "cpu", timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:4] for line in proc.stdout.splitlines() if line.startswith("| llama-tiny")]
    assert [[c.strip() for c in row] for row in rows] == [["llama-tiny:q4_0", "native", "pp8"],
                                                          ["llama-tiny:q4_0", "native", "tg4"]]
    base_rec, new_rec = (json.loads((out / f"{n}.json").read_text()) for n in ("base", "new"))
    # the base run imported the copy (no git there), the new one this checkout
    assert {r["apir_commit"] for r in base_rec} == {None}
    assert all(r["apir_commit"] for r in new_rec)


def test_several_bases_each_measured_and_compared_with_this_checkout(tmp_path: Path) -> None:
    # the steps of a series of changes in one call: each base by its directory's name
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    for name in ("first", "second"):
        assert script("--ref", "HEAD", "--base-only", str(tmp_path / name)).returncode == 0
    new = tmp_path / "new"
    new.mkdir()
    proc = script("--base", str(new), "-p", "8")
    assert proc.returncode == 2 and proc.stderr.startswith("bench-ab: ") and "holds no apir package" in proc.stderr
    out = tmp_path / "out"
    proc = script("--base", str(tmp_path / "first"), "--base", str(tmp_path / "second"), "--out", str(out), "--",
                  "--synthetic", "llama-tiny:q4_0", "-p", "8", "-n", "4", "-r", "1", "--backends", "native",
                  "--device", "cpu", timeout=400)
    assert proc.returncode == 0, proc.stderr
    order = [line for line in proc.stdout.splitlines() if line.startswith("bench-ab: ") and "->" in line]
    assert order == ["bench-ab: first -> new", "bench-ab: second -> new"]
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in proc.stdout.splitlines()
            if line.startswith("| llama-tiny")]
    assert rows == [["llama-tiny:q4_0", "native", "pp8"], ["llama-tiny:q4_0", "native", "tg4"]] * 2
    assert {p.name for p in out.glob("*.json")} == {"first.json", "second.json", "new.json"}
