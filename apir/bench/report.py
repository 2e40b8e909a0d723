"""Benchmark records out: a llama-bench markdown table, JSON, JSONL, CSV; the history file.

A record is a flat dict (see ``FIELDS``); the records of one ``apir bench`` run share a
``run_id``. The history file is JSONL, appended to by every run.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from .errors import BenchError

# Every field, in CSV column order (JSON carries the same keys).
FIELDS = (
    "run_id", "date", "apir_version", "apir_commit", "torch_version", "python_version",
    "cpu_info", "n_cpus", "model", "model_type", "model_size", "model_params", "synthetic",
    "backend", "device", "device_kind", "n_ctx", "n_prompt", "n_gen", "n_depth", "kv_type",
    "test", "n_reps", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ns", "samples_ts",
    "pct_native", "gpu_memory",
)
FORMATS = ("md", "json", "jsonl", "csv")


def fmt_size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def fmt_pct(p: float | None) -> str:
    return "" if p is None else f"{p:.2f}"


def table(head: Sequence[str], rows: Sequence[Sequence[str]], right: set[str]) -> str:
    """A markdown table, padded like llama-bench's; columns named in ``right`` align right."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(
            c.rjust(w) if h in right else c.ljust(w) for c, w, h in zip(cells, widths, head)
        ) + " |"

    rule = "| " + " | ".join(
        "-" * (w - 1) + ":" if h in right else "-" * w for w, h in zip(widths, head)
    ) + " |"
    return "\n".join([line(head), rule, *(line(row) for row in rows)]) + "\n"


def markdown(records: Sequence[dict]) -> str:
    """llama-bench's table (model, size, params, backend, test, t/s) plus ``% native``."""
    rows = [
        (r["model"], fmt_size(r["model_size"]), fmt_params(r["model_params"]), r["backend"],
         r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", fmt_pct(r.get("pct_native")))
        for r in records
    ]
    head = ("model", "size", "params", "backend", "test", "t/s", "% native")
    return table(head, rows, {"size", "params", "t/s", "% native"}) + "\n" + footer(records) + "\n"


def footer(records: Sequence[dict]) -> str:
    """One line under the table: devices per backend, versions, commit, date."""
    if not records:
        return ""
    r0 = records[0]
    devices = dict.fromkeys(f"{r['backend']}: {r['device']} ({r['device_kind']})" for r in records)
    commit = (r0.get("apir_commit") or "unknown")[:9]
    torch = r0.get("torch_version") or "absent"
    return (f"apir {r0['apir_version']} ({commit}), torch {torch}, {r0['date']}; "
            + "; ".join(devices) + f"; {r0['n_reps']} reps")


def render(records: Sequence[dict], fmt: str) -> str:
    if fmt == "md":
        return markdown(records)
    if fmt == "json":
        return json.dumps(list(records), indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in records)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in records:
            w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})
        return buf.getvalue()
    raise BenchError(f"unknown output format {fmt!r}: choose one of {', '.join(FORMATS)}")


def append_history(path: Path, records: Sequence[dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(render(records, "jsonl"))
    except OSError as e:
        raise BenchError(f"cannot append to the history file {path}: {e.strerror or e}") from None


def emit(records: list[dict], output: str, history: str | None) -> None:
    """Print ``records`` in ``output`` format on stdout; append them to the ``history``
    file unless it is None."""
    import sys

    sys.stdout.write(render(records, output))
    sys.stdout.flush()
    if history is not None:
        path = Path(history).expanduser()
        append_history(path, records)
        print(f"bench: appended {len(records)} records to {path}", file=sys.stderr, flush=True)
