"""GGUFFile's reading of metadata the user sees: the file type `apir info` reports."""

from __future__ import annotations

import gguf
import pytest
from tiny_models import TinyConfig, write_tiny_gguf

from apir.models.gguf_file import GGUFFile
from apir.models.resolve import resolve_model


@pytest.mark.parametrize("file_type, shown", [
    (gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K_M"),
    (gguf.LlamaFileType.ALL_F32, "F32"),
    (gguf.LlamaFileType.MOSTLY_Q5_K_S | gguf.LlamaFileType.GUESSED, "Q5_K_S"),
])
def test_file_type_comes_from_general_file_type(tmp_path, file_type, shown):
    path = write_tiny_gguf(tmp_path / "m.gguf", TinyConfig(), weight_type="Q8_0", file_type=file_type)
    assert GGUFFile(path).quantization() == shown


def test_without_file_type_the_commonest_weight_type(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", TinyConfig(), weight_type="Q8_0")
    assert GGUFFile(path).quantization() == "Q8_0"


def test_gemma3_q4_k_m_is_shown_as_such():
    try:
        path = resolve_model("gemma3-270m")
    except Exception as e:  # noqa: BLE001 - the packaged model is a test-setup install
        pytest.skip(f"gemma3-270m is not installed: {e}")
    assert GGUFFile(path).quantization() == "Q4_K_M"
