"""The guest side (graphs, the numpy backend, GGUF reading, tokenizer) needs no torch.

Each check runs in a fresh interpreter where ``import torch`` fails, as on a guest VM
installed without the ``host`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    for mod in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[mod]
    sys.meta_path.insert(0, BlockTorch())
    sys.modules["torch"] = None  # belt and braces: `import torch` raises ImportError
    """
)

GUEST = textwrap.dedent(
    """
    import importlib.util
    import json

    import numpy as np

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("torch was importable despite the blocker")

    import apir
    import apir.backends
    import apir.backends.numpy_ref
    import apir.graph
    import apir.models.gguf_file
    from apir.backends import BackendError, create_backend
    from apir.graph import DType, GraphBuilder, T

    optional = []
    for name in ("apir.models.tokenizer",):
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
            optional.append(name)

    be = create_backend("numpy")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = be.alloc_buffer(w.nbytes)
    be.set_tensor(h, 0, w)
    g = GraphBuilder()
    x = g.input("x", (T, 4))
    y = g.matmul(g.rms_norm(x, 1e-6), g.weight(h, 0, (3, 4), DType.F32))
    gid = be.register_graph(g.build(y, g.argmax(y)))
    out, top = be.compute(gid, {"x": np.ones((2, 4), np.float32)})

    try:
        create_backend("local")
    except BackendError as e:
        local_error = str(e)
    else:
        local_error = None

    print(json.dumps({
        "out": out.tolist(),
        "top": top.tolist(),
        "local_error": local_error,
        "optional": optional,
        "torch_loaded": [m for m in sys.modules if m.startswith("torch") and sys.modules[m]],
    }))
    """
)


def _run_without_torch(code: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"guest subprocess failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def guest() -> dict:
    return _run_without_torch(GUEST)


def test_guest_runs_a_graph_without_torch(guest: dict) -> None:
    res = guest
    # rms_norm of ones is ones; each output is the sum of a weight row
    assert np.allclose(res["out"], [[6.0, 22.0, 38.0]] * 2, rtol=1e-5)
    assert res["top"] == [2, 2]
    assert res["torch_loaded"] == []
    if (ROOT / "apir" / "models" / "tokenizer.py").exists():
        assert res["optional"] == ["apir.models.tokenizer"]


def test_local_backend_without_torch_says_how_to_install(guest: dict) -> None:
    msg = guest["local_error"]
    assert msg is not None, "create_backend('local') worked without torch"
    assert "torch" in msg.lower() and "apir[host]" in msg
