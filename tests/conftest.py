import sys
from pathlib import Path

# tests import their helpers (tiny_models) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from hosts import start_host  # noqa: E402


@pytest.fixture(scope="session")
def host(tmp_path_factory):
    """One real daemon (unix + tcp) shared by the test session."""
    h = start_host(tmp_path_factory.mktemp("host"))
    yield h
    h.stop()


@pytest.fixture(scope="session")
def backend_options(host):
    """apir.load keyword arguments per backend name, remote ones through the daemon."""
    return {
        "local": {"backend": "local", "device": "cpu"},
        "cuda": {"backend": "local", "device": "cuda"},
        "numpy": {"backend": "numpy"},
        "remote-unix": {"backend": "remote", "remote": host.unix},
        "remote-tcp": {"backend": "remote", "remote": host.tcp, "token": Path(host.token_file).read_text().strip()},
    }


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _no_user_config(tmp_path_factory):
    """Tests never read the developer's ~/.config/apir/config.toml (subprocesses inherit this)."""
    import os

    empty = tmp_path_factory.mktemp("config") / "config.toml"
    empty.write_text("")
    old = os.environ.get("APIR_CONFIG")
    os.environ["APIR_CONFIG"] = str(empty)
    yield
    if old is None:
        os.environ.pop("APIR_CONFIG", None)
    else:
        os.environ["APIR_CONFIG"] = old
