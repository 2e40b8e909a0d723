"""Every environment variable apir reads, declared once: name, type, default, meaning.

Precedence everywhere: command-line flag > environment variable > built-in default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    help: str

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        return value if value not in (None, "") else self.default


CACHE_DIR = EnvVar(
    "APIR_CACHE_DIR", str(Path.home() / ".cache" / "apir" / "models"),
    "where models assembled from several packages (gemma3-270m) are cached",
)
MODEL = EnvVar("APIR_MODEL", None, "default model name or .gguf path for -m")
BACKEND = EnvVar("APIR_BACKEND", "local", "default backend: local (PyTorch) or numpy")
DEVICE = EnvVar("APIR_DEVICE", None, "default device for the local backend: cpu, cuda or mps")
CTX_SIZE = EnvVar("APIR_CTX_SIZE", None, "context window in tokens (default: min(4096, the model's))")

ALL = (CACHE_DIR, MODEL, BACKEND, DEVICE, CTX_SIZE)
