"""``apir bench compare BASE NEW``: two result files side by side, per (model, backend, test).

A file is what ``-o json`` (a list) or ``-o jsonl`` wrote, or the history file. When a key
appears more than once (a history of many runs), its last record counts: the newest run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import BenchInputError
from .report import table

Key = tuple[str, str, str]  # (model, backend, test)
REQUIRED = ("model", "backend", "test", "avg_ts")


def load_records(path: str | Path, required: Sequence[str] = REQUIRED, what: str = "bench") -> list[dict]:
    """Records (dicts holding every ``required`` key) from a JSON list or JSONL file (``what``
    wrote it: apir's bench, llama-bench); any problem is one ``BenchInputError`` line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchInputError(f"no such results file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BenchInputError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise BenchInputError(f"{path} is not {what} JSON or JSONL ({e})") from None
    if not isinstance(records, list) or not records:
        raise BenchInputError(f"{path} holds no {what} records")
    for i, r in enumerate(records):
        if not isinstance(r, dict) or any(k not in r for k in required):
            raise BenchInputError(
                f"{path}: record {i + 1} is not a {what} record (needs {', '.join(required)})"
            )
    return records


def latest(records: Sequence[dict]) -> dict[Key, dict]:
    """The last record of each (model, backend, test), keeping first-seen order."""
    out: dict[Key, dict] = {}
    for r in records:
        out[(r["model"], r["backend"], r["test"])] = r
    return out


@dataclass(frozen=True)
class Row:
    key: Key
    base: float | None  # avg t/s
    new: float | None

    @property
    def change(self) -> float | None:
        """Percent change of NEW over BASE (negative = slower)."""
        if self.base is None or self.new is None or self.base <= 0:
            return None
        return 100.0 * (self.new - self.base) / self.base


def compare(base: Sequence[dict], new: Sequence[dict]) -> list[Row]:
    b, n = latest(base), latest(new)
    keys = list(b) + [k for k in n if k not in b]
    return [
        Row(k, b[k]["avg_ts"] if k in b else None, n[k]["avg_ts"] if k in n else None)
        for k in keys
    ]


def regressions(rows: Sequence[Row], max_regression: float) -> list[Row]:
    return [r for r in rows if r.change is not None and r.change < -max_regression]


def render(rows: Sequence[Row], max_regression: float) -> str:
    """A markdown table; regressions beyond the threshold are marked."""
    bad = {id(r) for r in regressions(rows, max_regression)}

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def cells(r: Row) -> tuple[str, ...]:
        change = "-" if r.change is None else f"{r.change:+.2f}%"
        return (*r.key, num(r.base), num(r.new), change + (" REGRESSION" if id(r) in bad else ""))

    head = ("model", "backend", "test", "base t/s", "new t/s", "change")
    return table(head, [cells(r) for r in rows], {"base t/s", "new t/s", "change"})
