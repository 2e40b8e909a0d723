"""The model store behind ``apir pull``, ``apir list`` and ``apir rm``.

Three kinds of model, by where the bytes come from:

  package  a name in ``KNOWN_MODELS``: the GGUF ships in pip packages (gemma3-270m is
           assembled from four into the cache by ``resolve_model``). apir never uninstalls
           a package; ``rm`` removes only a cached assembly.
  file     a .gguf of the user's, registered under its file stem. Never moved or deleted.
  hf       ``hf://org/repo[@revision]/path/file.gguf``, downloaded into the cache (resumable:
           bytes land in ``<file>.part`` and an interrupted pull continues with an HTTP
           Range request). apir owns these and ``rm`` deletes them.

Registrations live in ``<cache dir>/index.json``, written atomically:
``{"version": 1, "models": {name: {"path": str, "source": "file" | "hf://...",
"added": unix time, "sha256": hex or null}}}``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from . import __version__, env
from .env import cache_dir
from .errors import ApirError
from .models.errors import ModelNotFoundError
from .models.gguf_file import GGUFFile
from .models.resolve import KNOWN_MODELS, KnownModel, resolve_model

INDEX_VERSION = 1
TIMEOUT = 30.0  # seconds without a byte before a download gives up (it can be resumed)
CHUNK = 1 << 20

Progress = Callable[[int, int], None]  # (bytes done, bytes total or 0 when unknown)
# A model name, and each part of an hf:// reference (org, repo, revision, folder, file):
# a whitelist, so that no part is "." or "..", holds a separator, or hides an "@".
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")


class StoreError(ApirError):
    """A pull, list or rm that cannot be done: one line saying what to do instead."""


@dataclass(frozen=True)
class StoredModel:
    name: str
    path: Path
    size: int  # bytes; 0 when the file is missing
    modified: float  # mtime; 0 when the file is missing
    source: str  # "package", "file", or the hf:// reference
    present: bool = True  # False: registered, but its file is gone

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "size": self.size,
                "modified": datetime.fromtimestamp(self.modified).isoformat(timespec="seconds")
                if self.present else None,
                "source": self.source, "present": self.present}


# ---------------------------------------------------------------- the index
def index_file() -> Path:
    return cache_dir() / "index.json"


def _read_index() -> dict[str, dict]:
    path = index_file()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise StoreError(f"the model index {path} is unreadable ({e}); delete it and pull again") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("path"), str) for v in models.values()
    ):
        raise StoreError(f"the model index {path} is malformed; delete it and pull again")
    return models


def _write_index(models: dict[str, dict]) -> None:
    path = index_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".index.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": INDEX_VERSION, "models": models}, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def lookup(name: str) -> Path | None:
    """The file registered as ``name`` (by ``apir pull``), or None."""
    entry = _read_index().get(name)
    return Path(entry["path"]) if entry else None


def _inside(path: Path, root: Path) -> Path:
    """``path`` resolved (links followed, ".." gone), refused unless it lies in ``root``:
    checked before anything is written or deleted."""
    resolved, top = path.resolve(), root.resolve()
    if not resolved.is_relative_to(top):
        raise StoreError(f"{path} is outside the model store {top}; refusing to write or delete it")
    return resolved


def _register(name: str, path: Path, source: str, sha256: str | None) -> None:
    if not NAME.fullmatch(name):
        raise StoreError(f"cannot register {path.name[:100]!r}: {name[:100]!r} is not a model name (letters, "
                         "digits and . _ + - , not first; 128 at most); rename the file")
    if name in KNOWN_MODELS:
        raise StoreError(f"cannot register {path.name} as {name!r}: that name is a packaged "
                         "model; rename the file")
    models = _read_index()
    old = models.get(name)
    if old is not None and Path(old["path"]) != path:
        raise StoreError(f"{name!r} is already registered for {old['path']}; "
                         f"run `apir rm {name}` first")
    models[name] = {"path": str(path), "source": source, "added": int(time.time()), "sha256": sha256}
    _write_index(models)


# ---------------------------------------------------------------- pull
def pull(spec: str, progress: Progress | None = None, timeout: float = TIMEOUT) -> StoredModel:
    """Make ``spec`` (a known name, a .gguf path or an hf:// reference) ready to run."""
    if spec in KNOWN_MODELS:
        return _pull_known(KNOWN_MODELS[spec])
    if spec.startswith("hf://"):
        return _pull_hf(spec, progress, timeout)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf") or "/" in spec or os.sep in spec or path.exists():
        if not path.is_file():
            raise ModelNotFoundError(f"model file not found: {path}")
        path = path.resolve()
        _check_gguf(path)
        _register(path.stem, path, "file", None)
        return _stored(path.stem, path, "file")
    raise ModelNotFoundError(
        f"unknown model {spec!r}: give one of {', '.join(KNOWN_MODELS)}, a .gguf path, "
        "or hf://org/repo/file.gguf"
    )


def _pull_known(model: KnownModel) -> StoredModel:
    cached = cache_dir() / model.filename
    if len(model.files) > 1 and cached.is_file() and model.sha256 is not None:
        if _sha256_file(cached) != model.sha256:
            cached.unlink()  # a corrupt assembly: resolve_model assembles it again
    path = resolve_model(model.name, cache_dir())  # not installed: raises with the pip command
    if len(model.files) == 1 and model.sha256 is not None and _sha256_file(path) != model.sha256:
        raise StoreError(f"{path} does not match its sha256; reinstall: {model.install_hint} "
                         "--force-reinstall")
    _check_gguf(path)
    return _stored(model.name, path, "package")


def _check_gguf(path: Path) -> GGUFFile:
    """Open ``path`` as GGUF (magic, metadata, tensor table); raises ModelLoadError."""
    return GGUFFile(path)


def parse_hf(ref: str) -> tuple[str, str, str]:
    """``hf://org/repo[@rev]/path/file.gguf`` -> (``org/repo``, revision, ``path/file.gguf``)."""
    parts = ref.removeprefix("hf://").split("/")
    if len(parts) < 3 or not parts[-1].lower().endswith(".gguf"):
        raise StoreError(f"bad reference {ref[:200]!r}: expected hf://org/repo[@revision]/file.gguf")
    repo, at, revision = parts[1].partition("@")
    for part in [parts[0], repo, *([revision] if at else []), *parts[2:]]:
        if not NAME.fullmatch(part):
            raise StoreError(f"bad reference {ref[:200]!r}: {part[:100]!r} is not a name (letters, "
                             "digits and . _ + - , not first)")
    return f"{parts[0]}/{repo}", revision or "main", "/".join(parts[2:])


def _pull_hf(ref: str, progress: Progress | None, timeout: float) -> StoredModel:
    repo, revision, file = parse_hf(ref)
    dest = _inside(cache_dir() / "hf" / repo / revision / file, cache_dir() / "hf")
    name = dest.stem  # a valid name: the file's name is one
    if name in KNOWN_MODELS:
        raise StoreError(f"cannot register {dest.name} as {name!r}: that name is a packaged model")
    old = lookup(name)
    if old is not None and old != dest:
        raise StoreError(f"{name!r} is already registered for {old}; run `apir rm {name}` first")
    quote = urllib.parse.quote
    url = (f"{env.HF_ENDPOINT.get().rstrip('/')}/{quote(repo)}/resolve/{quote(revision, safe='')}/"
           f"{quote(file)}")
    token = env.HF_TOKEN.get()
    sha = None
    if not dest.is_file():
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        sha = download(url, dest, progress, timeout, headers, what=ref)
    try:
        _check_gguf(dest)
    except ApirError:
        dest.unlink(missing_ok=True)  # ours, and useless
        raise
    _register(name, dest, ref, sha)
    return _stored(name, dest, ref)


# ---------------------------------------------------------------- downloads
class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects, noting the Hub's ``X-Linked-Etag`` (the sha256 of an LFS file)
    and dropping the token when the redirect leaves the host (the Hub sends to a CDN)."""

    def __init__(self) -> None:
        super().__init__()
        self.sha256: str | None = None

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.sha256 = self.sha256 or _sha_from_etag(headers.get("X-Linked-Etag"))
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


def _sha_from_etag(etag: str | None) -> str | None:
    value = (etag or "").strip().removeprefix("W/").strip('"').lower()
    return value if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else None


def download(
    url: str, dest: Path, progress: Progress | None = None, timeout: float = TIMEOUT,
    headers: dict[str, str] | None = None, sha256: str | None = None, what: str | None = None,
) -> str:
    """Fetch ``url`` into ``dest`` through ``dest.part``, resuming a partial download.

    The sha256 is checked against ``sha256`` or, failing that, against the one the server
    names in ``X-Linked-Etag``. Returns the file's sha256. An interrupted transfer keeps
    its ``.part`` (run again to resume); a corrupt one is deleted.
    """
    what = what or url
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    redirects = _Redirects()
    opener = urllib.request.build_opener(redirects)
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"User-Agent": f"apir/{__version__}", **(headers or {})})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = opener.open(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing after `have`: the part is whole, or wrong
            whole = e.headers.get("Content-Range", "") == f"bytes */{have}"
            if not whole:
                part.unlink()
                return download(url, dest, progress, timeout, headers, sha256, what)
            response = None
        else:
            raise _http_error(e, what) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StoreError(
            f"cannot download {what}: {urllib.parse.urlsplit(url).netloc} is unreachable ({reason}); "
            "without a network, fetch the .gguf elsewhere and `apir pull /path/to/file.gguf`"
        ) from None
    digest = hashlib.sha256()
    total = have
    if response is not None:
        with response:
            resumed = have and response.status == 206 and \
                response.headers.get("Content-Range", "").startswith(f"bytes {have}-")
            start = have if resumed else 0
            length = response.headers.get("Content-Length")
            total = start + int(length) if length and length.isdigit() else 0
            done = start
            if start:
                _hash_into(digest, part)
            with part.open("ab" if start else "wb") as out:
                try:
                    while block := response.read(CHUNK):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if progress:
                            progress(done, total)
                except OSError as e:
                    raise StoreError(f"download of {what} interrupted at {done / 1e6:.1f} MB ({e}); "
                                     "run the same pull again to resume") from None
            if total and done != total:
                raise StoreError(f"download of {what} ended early ({done} of {total} bytes); "
                                 "run the same pull again to resume")
    else:
        _hash_into(digest, part)
    expected = sha256 or redirects.sha256 or (
        _sha_from_etag(response.headers.get("X-Linked-Etag")) if response is not None else None)
    got = digest.hexdigest()
    if expected is not None and got != expected:
        part.unlink(missing_ok=True)
        raise StoreError(f"download of {what} is corrupt (sha256 {got}, expected {expected}); "
                         "it was deleted: pull again")
    os.replace(part, dest)
    return got


def _http_error(e: urllib.error.HTTPError, what: str) -> StoreError:
    if e.code in (401, 403):
        return StoreError(f"cannot download {what}: HTTP {e.code} (gated or private: accept its "
                          "terms on the Hub and set HF_TOKEN)")
    if e.code == 404:
        return StoreError(f"cannot download {what}: not found (check the repo, revision and file name)")
    return StoreError(f"cannot download {what}: HTTP {e.code} {e.reason}")


def _hash_into(digest: hashlib._Hash, path: Path) -> None:
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    _hash_into(digest, path)
    return digest.hexdigest()


# ---------------------------------------------------------------- list and rm
def _installed_parts(model: KnownModel) -> list[Path] | None:
    """The package files of ``model``, or None when a package is missing (never imported)."""
    parts = []
    for f in model.files:
        spec = importlib.util.find_spec(f.module)
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.origin).parent / f.relpath
        if not path.is_file():
            return None
        parts.append(path)
    return parts


def _stored(name: str, path: Path, source: str) -> StoredModel:
    try:
        st = path.stat()
    except OSError:
        return StoredModel(name, path, 0, 0.0, source, present=False)
    return StoredModel(name, path, st.st_size, st.st_mtime, source)


def list_models() -> list[StoredModel]:
    """Installed packaged models, then registered files, by name."""
    out = []
    for model in KNOWN_MODELS.values():
        parts = _installed_parts(model)
        if parts is None:
            continue
        assembled = cache_dir() / model.filename
        if len(parts) == 1 or assembled.is_file():
            out.append(_stored(model.name, parts[0] if len(parts) == 1 else assembled, "package"))
        else:  # installed, assembled on first use
            out.append(StoredModel(model.name, assembled, sum(p.stat().st_size for p in parts),
                                   max(p.stat().st_mtime for p in parts), "package"))
    for name, entry in sorted(_read_index().items()):
        out.append(_stored(name, Path(entry["path"]), entry.get("source", "file")))
    return out


def remove(name: str) -> str:
    """Forget ``name``; delete only what apir made. Returns what was done, one line."""
    if name in KNOWN_MODELS:
        model = KNOWN_MODELS[name]
        uninstall = "pip uninstall -y " + " ".join(model.packages)
        assembled = cache_dir() / model.filename
        if len(model.files) > 1 and assembled.is_file():
            assembled.unlink()
            return (f"removed {assembled} (the assembled copy); the packages stay installed: "
                    f"to remove them too, {uninstall}")
        raise StoreError(f"{name} comes with pip packages, which apir does not remove: {uninstall}")
    models = _read_index()
    entry = models.pop(name, None)
    if entry is None:
        raise ModelNotFoundError(f"no model named {name!r} (see `apir list`)")
    _write_index(models)
    path = Path(entry["path"])
    if not str(entry.get("source", "")).startswith("hf://"):
        return f"unregistered {name}; the file {path} is kept"
    hf = (cache_dir() / "hf").resolve()
    try:
        path = _inside(path, hf)  # an edited index cannot point rm elsewhere
    except StoreError:
        return f"unregistered {name}; the file {path} is outside the store and kept"
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".part").unlink(missing_ok=True)
    for parent in path.parents:  # tidy empty directories up to <cache>/hf
        if parent == hf:
            break
        try:
            parent.rmdir()
        except OSError:
            break
    return f"removed {name} ({path})"


# ---------------------------------------------------------------- command line
def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def _progress_bar(label: str) -> Progress:
    start, last = time.perf_counter(), [0.0]
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        finished = total and done >= total
        if not tty and not finished or tty and not finished and now - last[0] < 0.1:
            return
        last[0] = now
        pct = f" {100 * done / total:5.1f}%" if total else ""
        rate = done / 1e6 / max(now - start, 1e-9)
        print(f"\r{label}: {done / 1e6:8.1f}/{total / 1e6:.1f} MB{pct} ({rate:,.1f} MB/s)",
              end="\n" if finished else "", file=sys.stderr, flush=True)

    return report


def cmd_pull(args: argparse.Namespace) -> int:
    m = pull(args.model, progress=_progress_bar(f"downloading {Path(args.model).name}"))
    print(f"{m.name}: ready ({_human(m.size)}, {m.path})", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    models = list_models()
    if args.json:
        print(json.dumps([m.to_json() for m in models], indent=2))
        return 0
    width = max([len("NAME"), *(len(m.name) for m in models)])
    print(f"{'NAME':{width}}  {'SIZE':>9}  MODIFIED")
    for m in models:
        size = _human(m.size) if m.present else "missing"
        when = datetime.fromtimestamp(m.modified).strftime("%Y-%m-%d %H:%M") if m.present else "-"
        print(f"{m.name:{width}}  {size:>9}  {when}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    print(remove(args.name), file=sys.stderr)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="install check, download or register a model")
    p.add_argument("model", help=f"a known name ({', '.join(KNOWN_MODELS)}), a .gguf path "
                                 "(registered under its file stem), or hf://org/repo/file.gguf")
    p.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="models ready to run: NAME, SIZE, MODIFIED")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="forget a model (deletes only what apir downloaded or assembled)")
    rm.add_argument("name")
    rm.set_defaults(func=cmd_rm)
