"""``apir doctor`` on this machine's real answers, and with a real daemon to find."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hosts import start_host

from apir.cli import main

RUN_ENV = ("APIR_REMOTE", "APIR_DEVICE", "APIR_BACKEND", "APIR_MODEL", "APIR_TOKEN", "APIR_TOKEN_FILE")


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No run settings from the environment or a user config; the default socket in tmp."""
    for name in RUN_ENV:
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config.toml"
    config.write_text("")
    monkeypatch.setenv("APIR_CONFIG", str(config))
    runtime = tmp_path / "run"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def doctor(capsys, *args: str) -> tuple[int, dict[str, list[dict]]]:
    rc = main(["doctor", "--json", *args])
    checks = json.loads(capsys.readouterr().out)
    by_name: dict[str, list[dict]] = {}
    for c in checks:
        assert c["status"] in ("ok", "missing", "warn")
        by_name.setdefault(c["name"], []).append(c)
    return rc, by_name


def one(checks: dict[str, list[dict]], name: str) -> dict:
    (check,) = checks[name]
    return check


def test_doctor_reports_this_machine(clean_env, capsys):
    torch = pytest.importorskip("torch")
    rc, checks = doctor(capsys)
    assert rc == 0
    assert one(checks, "python")["status"] == "ok"
    assert one(checks, "torch")["status"] == "ok"
    assert torch.__version__ in one(checks, "torch")["detail"]
    cuda = one(checks, "cuda")
    if torch.cuda.is_available():
        assert cuda["status"] == "ok"
    else:  # this machine: a CPU-only torch
        assert cuda["status"] == "missing" and "--remote URL" in cuda["fix"]
    daemon = one(checks, "daemon")
    assert daemon["status"] == "missing"
    assert str(clean_env / "apir" / "apir.sock") in daemon["detail"]
    assert "apir host" in daemon["fix"] and "apir-host.service" in daemon["fix"]
    if shutil.which("bwrap"):  # scripts/test.sh installs it
        assert one(checks, "sandbox")["status"] == "ok"
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        assert one(checks, "kvm")["status"] == "ok"
    elif not Path("/dev/kvm").exists():
        assert one(checks, "kvm")["status"] == "missing"
    assert one(checks, "vsock")["status"] in ("ok", "warn", "missing")
    assert one(checks, "qemu")["status"] == ("ok" if shutil.which("qemu-system-x86_64") or
                                             shutil.which("qemu-system-aarch64") else "missing")
    default_model = checks["model"][0]
    assert "smollm2-135m" in default_model["detail"]
    assert "gemma3-270m" in checks["model"][1]["detail"]
    run = one(checks, "run")
    assert run["detail"].startswith("apir run would use: ")
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert "local cpu" in run["detail"] and "no GPU" in run["detail"]
        assert run["status"] == "warn" and "--remote URL" in run["fix"]


def test_doctor_text_lines_and_flags(clean_env, capsys):
    pytest.importorskip("torch")
    assert main(["doctor", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    checks = [line for line in lines if not line.startswith(" ")]
    assert all(line.split()[0] in ("ok", "missing", "warn") for line in checks)
    assert checks[-1].split()[:2] == ["ok", "run"] and checks[-1].endswith("local cpu")
    fixes = [line.strip() for line in lines if line.startswith(" ")]
    assert fixes and all(f.startswith("fix: ") for f in fixes)
    assert main(["doctor", "--backend", "numpy"]) == 0
    assert "numpy" in capsys.readouterr().out.splitlines()[-1]


def test_doctor_remote_that_does_not_answer_fails(clean_env, capsys):
    rc, checks = doctor(capsys, "--remote", f"unix://{clean_env}/nobody.sock")
    assert rc == 1
    assert one(checks, "daemon")["status"] == "missing"
    assert one(checks, "run")["status"] == "missing"


def test_doctor_finds_a_running_daemon(clean_env, capsys, monkeypatch):
    (clean_env / "apir").mkdir()
    host = start_host(clean_env / "apir")  # listens at the default socket: $XDG_RUNTIME_DIR/apir
    try:
        rc, checks = doctor(capsys)
        daemon = one(checks, "daemon")
        assert daemon["status"] == "ok", daemon
        assert "0 of" in daemon["detail"] and "sessions" in daemon["detail"]
        assert "cpu" in daemon["detail"]

        rc, checks = doctor(capsys, "--remote", "auto")
        assert rc == 0 and "(the running daemon)" in one(checks, "run")["detail"]

        monkeypatch.setenv("XDG_RUNTIME_DIR", str(clean_env / "elsewhere"))
        monkeypatch.setenv("APIR_REMOTE", host.unix)  # the documented variable points it there
        rc, checks = doctor(capsys)
        assert rc == 0
        assert one(checks, "daemon")["status"] == "ok" and host.unix in one(checks, "daemon")["detail"]
        assert one(checks, "run")["detail"] == f"apir run would use: remote {host.unix}"

        monkeypatch.delenv("APIR_REMOTE")
        rc, checks = doctor(capsys, "--remote", host.tcp, "--token-file", host.token_file)
        assert rc == 0 and one(checks, "daemon")["status"] == "ok"
    finally:
        host.stop()


def test_cuda_without_triton_is_a_warning_that_names_the_slower_path(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    from apir import doctor

    props = SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30)
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                           get_device_properties=lambda i: props)
    fake_torch = SimpleNamespace(cuda=cuda, version=SimpleNamespace(cuda="12.6"), __version__="2.11.0")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    check = doctor.check_cuda(fake_torch)
    assert check.status == "warn" and "cuda:0 Fake GPU 80 GiB" in check.detail
    assert "no Triton" in check.detail and "cuBLAS" in check.detail and "triton" in check.fix
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert doctor.check_cuda(fake_torch).status == "ok"
