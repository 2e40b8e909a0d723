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
API_KEY = EnvVar(
    "APIR_API_KEY", None,
    "apir serve: require 'Authorization: Bearer KEY' on /v1/* (default: no key needed)",
)
HF_ENDPOINT = EnvVar(
    "HF_ENDPOINT", "https://huggingface.co",
    "apir pull hf://...: the Hugging Face Hub (or a mirror) to download from",
)
HF_TOKEN = EnvVar("HF_TOKEN", None, "apir pull hf://...: access token for gated or private repos")

REMOTE = EnvVar(
    "APIR_REMOTE", None,
    "guest: the host daemon's address (unix://PATH, tcp://HOST:PORT, vsock://CID:PORT, auto)",
)
TOKEN = EnvVar("APIR_TOKEN", None, "guest: the shared secret for tcp/vsock hosts")
TOKEN_FILE = EnvVar("APIR_TOKEN_FILE", None, "guest: a file holding that secret (wins over APIR_TOKEN)")
HOST_LISTEN = EnvVar("APIR_HOST_LISTEN", None, "host: default --listen address (default: the user's unix socket)")
BENCH_HISTORY = EnvVar(
    "APIR_BENCH_HISTORY", str(Path.home() / ".local" / "share" / "apir" / "bench.jsonl"),
    "apir bench: the JSONL file every run's records are appended to (--history wins)",
)

CUDA_GRAPHS = EnvVar("APIR_CUDA_GRAPHS", "1", "host: replay decode steps from captured CUDA graphs (0 = eager)")
COMPILE = EnvVar("APIR_COMPILE", "1", "host: torch.compile decode steps before capturing them (0 = capture eager kernels)")

SPIN_US = EnvVar("APIR_SPIN_US", "2000", "guest and host: busy-poll this many microseconds for a reply before sleeping")

ALL = (
    CACHE_DIR, MODEL, BACKEND, DEVICE, CTX_SIZE, API_KEY, HF_ENDPOINT, HF_TOKEN,
    REMOTE, TOKEN, TOKEN_FILE, HOST_LISTEN, BENCH_HISTORY,
)
