"""What the user sees on stderr: the CPU-fallback note, the auto-host spinner, the upload
progress bar. stdout stays the generated text alone."""

from __future__ import annotations

import io

import pytest
from tiny_models import write_tiny_gguf

from apir import cli, flags

NOTE = ("note: no GPU found (torch sees no CUDA/MPS device); running on the CPU — pass "
        "--device cpu to silence this, or --remote URL to use a host's GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture
def no_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has a GPU: nothing falls back to the CPU")


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    for name in ("APIR_REMOTE", "APIR_DEVICE", "APIR_BACKEND", "APIR_MODEL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("APIR_CONFIG", str(tmp_path / "config.toml"))


def test_cpu_fallback_note_wording():
    assert flags.cpu_fallback_note("local", None, "cpu") == NOTE
    assert flags.cpu_fallback_note("local", "cpu", "cpu") is None  # asked for: no note
    assert flags.cpu_fallback_note("local", None, "cuda") is None
    assert flags.cpu_fallback_note("numpy", None, "cpu") is None  # the reference runs on the cpu
    remote = flags.cpu_fallback_note("remote", None, "cpu", "tcp://box:7070")
    assert "tcp://box:7070" in remote and "--device cpu" in remote


def test_apir_run_says_it_fell_back_to_the_cpu(no_gpu, tiny, capsys):
    assert cli.main(["run", "-m", tiny, "-p", "Hi", "-n", "3", "--temp", "0"]) == 0
    out = capsys.readouterr()
    assert NOTE in out.err.splitlines()
    assert "note:" not in out.out
    assert cli.main(["run", "-m", tiny, "-p", "Hi", "-n", "3", "--temp", "0", "--device", "cpu"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_apir_serve_loader_says_the_same(no_gpu, tiny, capsys):
    from apir.server.app import load_model as serve_model

    with serve_model(flags.RunConfig(model=tiny)):
        pass
    assert f"apir serve: {NOTE}" in capsys.readouterr().err.splitlines()
    with serve_model(flags.RunConfig(model=tiny, device="cpu")):
        pass
    assert "note:" not in capsys.readouterr().err


def test_remote_auto_spinner_and_clean_stdout(tiny, tmp_path, monkeypatch, capsys):
    """--remote auto with no daemon: the CLI passes its spinner (here stderr is no TTY, so
    it says what it does once) and stdout still carries only the text."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert cli.main(["run", "--remote", "auto", "--device", "cpu", "-m", tiny, "-p", "Hi",
                     "-n", "3", "--temp", "0"]) == 0
    out = capsys.readouterr()
    assert out.err.count(flags.AUTO_HOST) == 1
    local = cli.main(["run", "-m", tiny, "-p", "Hi", "-n", "3", "--temp", "0", "--device", "cpu"])
    assert local == 0 and capsys.readouterr().out == out.out


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_spinner_draws_only_on_a_tty(monkeypatch):
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    spin = flags.Spinner("waiting")
    for _ in range(3):
        spin()
    spin.done()
    text = err.getvalue()
    assert text.count("\r") == 4 and "| waiting" in text and "/ waiting" in text
    assert text.endswith("\r\x1b[K")  # the line is erased once the daemon answers

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    spin = flags.Spinner("waiting")
    for _ in range(3):
        spin()
    spin.done()
    assert err.getvalue() == "waiting...\n"


def test_progress_bar_shows_bytes_speed_and_eta(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 4.0])
    monkeypatch.setattr(flags.time, "perf_counter", lambda: next(clock))
    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    report = flags.progress_bar("uploading weights")
    report(50_000_000, 200_000_000)  # 50 MB in 1 s: 150 MB left at 50 MB/s
    report(100_000_000, 200_000_000)
    report(200_000_000, 200_000_000)
    lines = err.getvalue().split("\r")[1:]
    assert "[#####---------------] 50.0 MB/200.0 MB  50.0 MB/s  ETA 0:03" in lines[0]
    assert "100.0 MB/200.0 MB  50.0 MB/s  ETA 0:02" in lines[1]
    assert "200.0 MB/200.0 MB  50.0 MB/s  in 4.0s" in lines[2] and lines[2].endswith("\n")


def test_progress_bar_off_a_tty_prints_only_the_end(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    report = flags.progress_bar("uploading weights")
    report(10, 1000)
    report(1000, 1000)
    assert err.getvalue().startswith("uploading weights: [####################] 1.0 kB/1.0 kB")
    assert err.getvalue().count("\n") == 1 and "\r" not in err.getvalue()
