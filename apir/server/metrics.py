"""Server counters and gauges, rendered in the Prometheus text format (version 0.0.4).

Updated from the event loop (requests) and from the generation thread (tokens), hence
the lock. Names follow Prometheus conventions: ``_total`` for counters, base units
(seconds) for times.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Gauges:
    """Values read at scrape time rather than counted."""

    loaded: bool
    queued: int
    round_trip_seconds: float | None  # the remote backend's last round trip; None = local
    slots: int = 1  # generations that can run at once (--parallel)
    slots_busy: int = 0  # of those, running now (batched serving only)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.generations = 0
        self.cancelled = 0
        self.in_flight = 0
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.last_tps = 0.0
        self._decode_tokens = 0  # tokens and seconds of decoding, for the average rate
        self._decode_seconds = 0.0

    def request_started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def request_finished(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[endpoint, status] += 1

    def request_counted(self, endpoint: str, status: int) -> None:
        """A request not counted in flight (health checks, scrapes)."""
        with self._lock:
            self.requests[endpoint, status] += 1

    def generation(self, prompt_tokens: int, generated: int, decode_seconds: float,
                   cancelled: bool = False) -> None:
        """One finished (or cancelled) generation; ``decode_seconds`` spans tokens 2..n."""
        with self._lock:
            self.generations += 1
            self.cancelled += cancelled
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated
            if generated > 1 and decode_seconds > 0:
                self.last_tps = (generated - 1) / decode_seconds
                self._decode_tokens += generated - 1
                self._decode_seconds += decode_seconds

    def render(self, gauges: Gauges) -> str:
        with self._lock:
            avg = self._decode_tokens / self._decode_seconds if self._decode_seconds else 0.0
            rows = [
                ("apir_prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
                ("apir_generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("apir_generations_total", "counter", "Generations run (including cancelled ones).",
                 self.generations),
                ("apir_generations_cancelled_total", "counter",
                 "Generations cancelled because the client went away.", self.cancelled),
                ("apir_requests_in_flight", "gauge", "/v1 requests being served or queued.",
                 self.in_flight),
                ("apir_requests_queued", "gauge", "Generations waiting for the model.", gauges.queued),
                ("apir_slots", "gauge", "Generations that can run at once (--parallel).", gauges.slots),
                ("apir_slots_busy", "gauge", "Slots running a generation now.", gauges.slots_busy),
                ("apir_generation_tokens_per_second", "gauge",
                 "Decode rate of the last generation (tokens/s).", self.last_tps),
                ("apir_generation_tokens_per_second_avg", "gauge",
                 "Decode rate over all generations (tokens/s).", avg),
                ("apir_remote_round_trip_seconds", "gauge",
                 "Last round trip to the remote backend's host (0 for local backends).",
                 gauges.round_trip_seconds or 0.0),
                ("apir_model_loaded", "gauge", "1 once the model is loaded and serving.", int(gauges.loaded)),
            ]
            requests = sorted(self.requests.items())
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]
        out += ["# HELP apir_requests_total HTTP requests by endpoint and status code.",
                "# TYPE apir_requests_total counter"]
        for (endpoint, status), n in requests:
            out.append(f'apir_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        return "\n".join(out) + "\n"


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"
