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


# ---------------------------------------------------------------- the header parser


def _same_as_gguf_py(path) -> GGUFFile:
    """GGUFFile reads ``path`` exactly as gguf-py's reader: every metadata value (type
    included), every value type, every tensor's type, shape and bytes."""
    import numpy as np

    ref, ours = gguf.GGUFReader(path), GGUFFile(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # gguf-py's own header fields
    assert list(ours.metadata) == keys
    for k in keys:
        want, got = ref.fields[k].contents(), ours.metadata[k]
        assert got == want and type(got) is type(want), k
        if isinstance(want, list):
            assert [type(x) for x in got] == [type(x) for x in want], k
        assert ours.value_types[k] == tuple(int(t) for t in ref.fields[k].types), k
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (int(mine.dtype), mine.shape) == (int(t.tensor_type), tuple(reversed(t.shape.tolist())))
        assert np.array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8)), t.name
    return ours


def _every_value_type(path, alignment: int | None = None):
    """A GGUF with a value of every type, scalar and array, and two tensors."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    T = gguf.GGUFValueType
    for vtype, value in [(T.UINT8, 200), (T.INT8, -100), (T.UINT16, 60000), (T.INT16, -30000),
                         (T.UINT32, 4_000_000_000), (T.INT32, -2_000_000_000), (T.FLOAT32, 0.1),
                         (T.BOOL, True), (T.STRING, "héllo ✓"), (T.UINT64, 2**63 + 5),
                         (T.INT64, -(2**62)), (T.FLOAT64, 1e-300)]:
        w.add_key_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
        if vtype is not T.STRING:
            w.add_key_value(f"test.array.{vtype.name.lower()}", [value, value], T.ARRAY, sub_type=vtype)
    w.add_key_value("test.array.string", ["", "a", "ü" * 40], T.ARRAY, sub_type=T.STRING)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.arange(64, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path, alignment):
    f = _same_as_gguf_py(_every_value_type(tmp_path / "v.gguf", alignment))
    assert f.get("test.scalar.string") == "héllo ✓" and f.get("test.array.uint64") == [2**63 + 5] * 2
    assert f.tensors["a"].shape == (3, 4) and f.tensors["a"].data.view("<f4").tolist() == list(range(12))


def test_models_read_as_gguf_py_reads_them(tmp_path):
    _same_as_gguf_py(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(), weight_type="Q8_0"))
    for name in ("smollm2-135m", "gemma3-270m"):
        try:
            path = resolve_model(name)
        except Exception:  # noqa: BLE001 - a packaged model not installed here
            continue
        f = _same_as_gguf_py(path)
        assert len(f.get("tokenizer.ggml.tokens")) == f.tensors["token_embd.weight"].shape[0]


def test_a_truncated_header_is_a_clear_error_at_every_length(tmp_path):
    """Cut anywhere in the header or the tensor data: ModelLoadError, never another
    exception, a read past the end or a hang."""
    from apir.models.errors import ModelLoadError

    whole = _every_value_type(tmp_path / "v.gguf").read_bytes()
    data_start = len(whole) - (4 * 12 + 64 * 2 + 32)  # about where the tensor data begins
    cut = tmp_path / "cut.gguf"
    for n in [*range(4, data_start), len(whole) - 1]:
        cut.write_bytes(whole[:n])
        with pytest.raises(ModelLoadError, match="truncated or corrupt|is truncated"):
            GGUFFile(cut)


@pytest.mark.parametrize("patch, message", [
    (lambda b: b[:4] + (3).to_bytes(4, "big") + b[8:], "big-endian GGUF"),
    (lambda b: b[:4] + (1).to_bytes(4, "little") + b[8:], "GGUF version 1 is not supported"),
    (lambda b: b[:16] + (2**40).to_bytes(8, "little") + b[24:], "the file ends inside"),
])
def test_a_corrupt_header_says_what_is_wrong(tmp_path, patch, message):
    from apir.models.errors import ModelLoadError

    path = _every_value_type(tmp_path / "v.gguf")
    path.write_bytes(patch(path.read_bytes()))
    with pytest.raises(ModelLoadError, match=message):
        GGUFFile(path)


def test_a_key_twice_and_an_unknown_value_type_are_refused(tmp_path):
    import struct

    from apir.models.errors import ModelLoadError

    def header(kvs: list[bytes]) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)

    def kv(key: str, vtype: int, payload: bytes) -> bytes:
        return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload

    arch = kv("general.architecture", 8, struct.pack("<Q", 5) + b"llama")
    for kvs, message in [([arch, arch], "general.architecture appears twice"),
                         ([arch, kv("x", 13, b"")], "the value of x has unknown value type 13")]:
        path = tmp_path / "bad.gguf"
        path.write_bytes(header(kvs))
        with pytest.raises(ModelLoadError, match=message):
            GGUFFile(path)


def test_crafted_headers_are_clear_errors_or_files(tmp_path):
    """Bytes changed anywhere in a header (seeded, 400 variants), and arrays nested past
    the bound: GGUFFile reads the file or raises ModelLoadError, nothing else."""
    import random
    import struct

    from apir.models.errors import ModelLoadError

    whole = bytearray(_every_value_type(tmp_path / "v.gguf").read_bytes())
    header = len(whole) - (4 * 12 + 64 * 2 + 64)  # the tensor data is at the end
    rng, path = random.Random(7), tmp_path / "x.gguf"
    for _ in range(400):
        data = bytearray(whole)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(4, header)
            data[at : at + 8] = rng.randbytes(rng.choice((1, 2, 4, 8)))[: len(data[at : at + 8])]
        path.write_bytes(data)
        try:
            GGUFFile(path)
        except ModelLoadError:
            pass
    nested = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + nested)
    with pytest.raises(ModelLoadError, match="nests arrays more than 8 deep"):
        GGUFFile(path)
