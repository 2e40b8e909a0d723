"""Configuration layers: flag > APIR_* environment variable > config file > default."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import write_tiny_gguf

from apir import env
from apir.cli import build_parser, main

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the config file needs tomllib")


@pytest.fixture
def config(tmp_path, monkeypatch):
    """Write the user config file (APIR_CONFIG points at it); no APIR_* run settings set."""
    for var in env.ALL:
        if var is not env.CONFIG:
            monkeypatch.delenv(var.name, raising=False)
    path = tmp_path / "config.toml"
    path.write_text("")
    monkeypatch.setenv("APIR_CONFIG", str(path))

    def write(text: str) -> Path:
        path.write_text(text)
        return path

    return write


def test_every_variable_has_a_config_key():
    keys = [var.key for var in env.ALL]
    assert len(set(keys)) == len(keys)
    assert env.MODEL.key == "model" and env.CTX_SIZE.key == "ctx_size" and env.HF_TOKEN.key == "hf_token"
    declared = {v for v in vars(env).values() if isinstance(v, env.EnvVar)}
    assert declared == set(env.ALL)  # every declared variable is listed (and configurable)


def test_env_beats_config_beats_default(config, monkeypatch):
    config('model = "gemma3-270m"\nctx_size = 8192\ncuda_graphs = false\nremote = "auto"\n')
    assert env.MODEL.lookup() == ("gemma3-270m", "config")
    assert env.CTX_SIZE.get() == "8192"
    assert env.CUDA_GRAPHS.get() == "0"  # booleans become the "1"/"0" the variables take
    assert env.BACKEND.lookup() == ("local", "default")
    monkeypatch.setenv("APIR_MODEL", "smollm2-135m")
    assert env.MODEL.lookup() == ("smollm2-135m", "env")
    monkeypatch.setenv("APIR_MODEL", "")  # empty means unset, as before
    assert env.MODEL.lookup() == ("gemma3-270m", "config")


def test_flags_beat_everything(config, monkeypatch):
    config('model = "gemma3-270m"\ndevice = "cuda"\nctx_size = 512\n')
    args = build_parser().parse_args(["run"])
    assert (args.model, args.device, args.ctx_size) == ("gemma3-270m", "cuda", 512)
    monkeypatch.setenv("APIR_DEVICE", "mps")
    args = build_parser().parse_args(["run", "-m", "x.gguf", "-c", "64"])
    assert (args.model, args.device, args.ctx_size) == ("x.gguf", "mps", 64)
    args = build_parser().parse_args(["run", "--device", "cpu"])
    assert args.device == "cpu"


def test_the_file_is_reread_when_it_changes(config):
    config('model = "a.gguf"\n')
    assert env.MODEL.get() == "a.gguf"
    config('model = "bb.gguf"\n')
    assert env.MODEL.get() == "bb.gguf"


def test_the_cache_dir_is_resolved_at_the_edge(config, tmp_path, monkeypatch):
    """The CLI reads cache_dir from the layers; the library resolver takes it as an argument."""
    from apir.flags import run_config
    from apir.models import resolve

    config(f'cache_dir = "{tmp_path / "models"}"\n')
    assert env.cache_dir() == tmp_path / "models"
    assert run_config(build_parser().parse_args(["run"])).cache_dir == tmp_path / "models"
    monkeypatch.setenv("APIR_CACHE_DIR", str(tmp_path / "env"))
    assert env.cache_dir() == tmp_path / "env"
    monkeypatch.setattr(resolve, "_resolve_known", lambda model, cache: cache)
    assert resolve.resolve_model("gemma3-270m") == resolve.DEFAULT_CACHE_DIR  # no layer read


def test_the_library_reads_no_config(config, monkeypatch):
    """apir.load is the library's edge: the config file's model and cache_dir never reach it."""
    import apir
    import apir.engine
    from apir.models import resolve
    from apir.models.errors import ModelNotFoundError

    config('model = "from-config.gguf"\ncache_dir = "/nonexistent"\n')
    asked = []

    def resolve_model(spec, cache_dir):
        asked.append((spec, cache_dir))
        raise ModelNotFoundError("resolved")

    monkeypatch.setattr(apir.engine, "resolve_model", resolve_model)
    with pytest.raises(ModelNotFoundError):
        apir.load()
    assert asked == [(None, resolve.DEFAULT_CACHE_DIR)]


@pytest.mark.parametrize("text, message", [
    ("model = \n", "invalid TOML"),
    ('modle = "x"\n', "unknown key 'modle'"),
    ("model = ['a', 'b']\n", "model must be a string, number or boolean"),
])
def test_a_bad_config_file_is_one_clear_line(config, capsys, text, message):
    path = config(text)
    with pytest.raises(env.ConfigError, match=message):
        env.MODEL.get()
    assert main(["info", "--config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and message in err


def test_a_named_config_file_must_exist(config, monkeypatch, tmp_path):
    monkeypatch.setenv("APIR_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(env.ConfigError, match="no such config file"):
        env.DEVICE.get()


def test_no_config_file_is_fine(monkeypatch, tmp_path):
    monkeypatch.delenv("APIR_CONFIG", raising=False)
    monkeypatch.delenv("APIR_BACKEND", raising=False)
    monkeypatch.setattr(env, "CONFIG", env.EnvVar("APIR_CONFIG", str(tmp_path / "none.toml"), ""))
    assert env.read_config() == {}
    assert env.BACKEND.lookup() == ("local", "default")


def test_info_config_names_each_source(config, capsys, monkeypatch):
    path = config('model = "gemma3-270m"\ntoken = "s3cret"\n')
    monkeypatch.setenv("APIR_DEVICE", "cpu")
    assert main(["info", "--config", "--backend", "numpy", "-c", "256"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if not line.startswith("#")}
    assert lines["APIR_MODEL"][1:] == ["gemma3-270m", "[config]"]
    assert lines["APIR_DEVICE"][1:] == ["cpu", "[env]"]
    assert lines["APIR_BACKEND"][1:] == ["numpy", "[flag]"]
    assert lines["APIR_CTX_SIZE"][1:] == ["256", "[flag]"]
    assert lines["APIR_TOKEN"][1:] == ["(set)", "[config]"]
    assert lines["APIR_REMOTE"][1:] == ["-", "[default]"]
    assert lines["APIR_CONFIG"][1:] == [str(path), "[env]"]
    assert main(["info", "--config", "--json", "--model=x.gguf"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config_file"] == str(path) and data["config_file_exists"]
    rows = {r["name"]: r for r in data["variables"]}
    assert rows["APIR_MODEL"]["value"] == "x.gguf" and rows["APIR_MODEL"]["source"] == "flag"


def test_info_on_a_model_still_works(config, capsys, tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    config(f'model = "{tiny}"\n')  # -m's default comes from the config file
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(tiny)
    assert main(["info", "-m", str(tiny)]) == 0
    assert "architecture    llama" in capsys.readouterr().out


def test_threads_flag_beats_env_beats_config_beats_the_cores(config, monkeypatch):
    from apir.flags import run_config

    assert build_parser().parse_args(["run"]).threads == env.default_threads()
    assert build_parser().parse_args(["host"]).threads == env.default_threads()
    config("threads = 3\n")
    assert run_config(build_parser().parse_args(["serve"])).threads == 3
    monkeypatch.setenv("APIR_THREADS", "5")
    assert build_parser().parse_args(["host"]).threads == 5
    assert run_config(build_parser().parse_args(["run", "-t", "2"])).threads == 2
    assert env.describe({"threads": 2})[[v.key for v in env.ALL].index("threads")]["source"] == "flag"

