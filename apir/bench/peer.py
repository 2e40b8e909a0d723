"""``apir bench peer``: llama.cpp's ``llama-bench -o json`` results beside ``apir bench -o
json`` results on the same GGUF files, apir ÷ llama.cpp per (model file, test).

llama-bench writes a JSON list of records, one per test, with (among others)
``model_filename`` (the -m path), ``model_size`` (tensor bytes), ``n_prompt``, ``n_gen``,
``n_depth``, ``type_k``, ``avg_ts`` and ``stddev_ts``; a test is ``ppN`` (n_gen 0) or
``tgN`` (n_prompt 0), at depth D named ``ppN@dD`` as apir names it. A model is matched by
its file name (apir names a ``-m`` path by its file name).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .compare import load_records
from .errors import BenchInputError
from .report import fmt_size, table

LLAMA_BENCH_REQUIRED = ("model_filename", "n_prompt", "n_gen", "avg_ts")


def llama_test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's test name (``pp512``, ``tg128``, ``pp512+tg128``), ``@dD`` at depth D."""
    parts = ([f"pp{n_prompt}"] if n_prompt else []) + ([f"tg{n_gen}"] if n_gen else [])
    return "+".join(parts) + (f"@d{n_depth}" if n_depth else "")


def load_llama_bench(path: str | Path) -> list[dict]:
    """The records of a ``llama-bench -o json`` (or ``-o jsonl``) file, each with ``model``
    (the file name) and ``test`` added; any problem is one ``BenchInputError`` line."""
    return [{**r, "model": Path(r["model_filename"]).name,
             "test": llama_test_name(int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth") or 0))}
            for r in load_records(path, LLAMA_BENCH_REQUIRED, "llama-bench")]


@dataclass(frozen=True)
class PeerRow:
    model: str
    test: str
    backend: str  # the apir backend
    llamacpp_ts: float
    apir_ts: float
    model_size: int  # the GGUF's tensor bytes, as llama-bench counts them
    memory: dict | None  # apir's gpu_memory: {"allocated", "peak"} bytes

    @property
    def ratio(self) -> float:
        return self.apir_ts / self.llamacpp_ts if self.llamacpp_ts > 0 else float("nan")


def pair(llamacpp: Sequence[dict], apir: Sequence[dict]) -> list[PeerRow]:
    """One row per apir record whose (model, test) llama-bench measured too (the last of
    each counts), in apir's order."""
    peers = {(r["model"], r["test"]): r for r in llamacpp}
    rows = []
    for r in apir:
        peer = peers.get((r["model"], r["test"]))
        if peer is not None:
            rows.append(PeerRow(r["model"], r["test"], r["backend"], float(peer["avg_ts"]),
                                float(r["avg_ts"]), int(peer.get("model_size") or 0), r.get("gpu_memory")))
    return rows


def render(rows: Sequence[PeerRow]) -> str:
    """A markdown table: both t/s, apir ÷ llama.cpp, apir's resident memory (allocated and
    peak) against the GGUF's tensor bytes."""
    def memory(r: PeerRow) -> str:
        if not r.memory:
            return "-"
        held, peak = r.memory["allocated"], r.memory["peak"]
        ratio = f" ({held / r.model_size:.2f}x)" if r.model_size else ""
        return f"{fmt_size(held)}{ratio}, peak {fmt_size(peak)}"

    head = ("model", "test", "llama.cpp t/s", "apir backend", "apir t/s", "apir ÷ llama.cpp",
            "GGUF tensors", "apir memory")
    cells = [(r.model, r.test, f"{r.llamacpp_ts:.2f}", r.backend, f"{r.apir_ts:.2f}", f"{r.ratio:.3f}",
              fmt_size(r.model_size) if r.model_size else "-", memory(r)) for r in rows]
    return table(head, cells, {"llama.cpp t/s", "apir t/s", "apir ÷ llama.cpp", "GGUF tensors"})


def run(llamacpp_files: Sequence[str], apir_files: Sequence[str]) -> str:
    """The table of ``apir bench peer``; no (model, test) in common is an error."""
    llamacpp = [r for f in llamacpp_files for r in load_llama_bench(f)]
    apir = [r for f in apir_files for r in load_records(f)]
    rows = pair(llamacpp, apir)
    if not rows:
        raise BenchInputError(
            "the llama-bench and apir results share no (model file, test): llama.cpp has "
            + ", ".join(sorted({f"{r['model']} {r['test']}" for r in llamacpp}))
            + "; apir has " + ", ".join(sorted({f"{r['model']} {r['test']}" for r in apir})))
    return render(rows)
