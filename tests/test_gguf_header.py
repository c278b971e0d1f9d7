"""tidyrun's GGUF header reader (``loader/gguf_header.py``) gives what gguf's GGUFReader gives: every
metadata value and every tensor's type, shape and data, for the bundled model and for written files with
every value type, a custom alignment, plain and quantized tensors, in both byte orders."""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tidyrun.loader.gguf_header import GGUFHeader  # noqa: E402


def assert_same_as_gguf(path: str) -> None:
    ref, ours = gguf.GGUFReader(path), GGUFHeader(path)
    assert {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")} == ours.fields
    assert ([(t.name, tuple(int(d) for d in t.shape), t.tensor_type) for t in ref.tensors]
            == [(t.name, t.shape, t.tensor_type) for t in ours.tensors])
    for a, b in zip(ref.tensors, ours.tensors):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_the_default_model_reads_as_gguf_reads_it(default_model):
    assert_same_as_gguf(default_model)


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_every_value_type_in_both_byte_orders(tmp_path, endian):
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian[endian])
    w.add_uint8("v.u8", 200)
    w.add_int8("v.i8", -3)
    w.add_uint16("v.u16", 60000)
    w.add_int16("v.i16", -1234)
    w.add_uint32("v.u32", 4_000_000_000)
    w.add_int32("v.i32", -7)
    w.add_uint64("v.u64", 2**40 + 3)
    w.add_int64("v.i64", -(2**40))
    w.add_float32("v.f32", 0.1)
    w.add_float64("v.f64", 1e-300)
    w.add_bool("v.bool", True)
    w.add_string("v.str", "héllo wörld")
    w.add_array("v.ints", [1, -2, 3])
    w.add_array("v.floats", [0.25, -1.5])
    w.add_array("v.strs", ["a", "", "ü" * 300])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain.f16", rng.standard_normal((4, 8)).astype(np.float16))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("quant.q8", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_gguf(path)
    header = GGUFHeader(path)
    assert header.fields["v.strs"][2] == "ü" * 300 and header.fields["general.alignment"] == 64
    assert np.allclose(gguf.quants.dequantize(header.tensors[2].data, q8), gguf.quants.dequantize(
        gguf.GGUFReader(path).tensors[2].data, q8))


@pytest.mark.parametrize("cut", [3, 20, 100, -1])
def test_a_cut_file_is_refused(tmp_path, default_model, cut):
    """A file cut anywhere in its header (or its last tensor) raises, never reads past its end."""
    with open(default_model, "rb") as f:
        head = f.read(cut if cut > 0 else None)
    path = tmp_path / "cut.gguf"
    path.write_bytes(head[:cut] if cut > 0 else head[:-1])
    with pytest.raises((ValueError, struct.error)):
        GGUFHeader(str(path))


def test_a_corrupt_dimension_count_is_refused(tmp_path, default_model):
    """A tensor claiming billions of dimensions is refused at once (not parsed into a giant format)."""
    header = GGUFHeader(default_model)
    raw = bytearray(open(default_model, "rb").read())
    name = header.tensors[0].name.encode()
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # the first tensor info's n_dims
    raw[at:at + 4] = (3_000_000_000).to_bytes(4, "little")
    path = tmp_path / "dims.gguf"
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="dimensions"):
        GGUFHeader(str(path))


def test_q4_1_weights_dequantize_to_ggufs_bits(default_model):
    """The loader's own Q4_1 dequantization (the default model's type; gguf's is 1.5 s of an engine start)
    gives gguf's float32 values bit for bit, on every Q4_1 tensor of the bundled model."""
    from tidyrun.loader.gguf import _dequantize_q4_1

    q4_1 = [t for t in GGUFHeader(default_model).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1]
    assert len(q4_1) > 100
    for t in q4_1:
        ours, theirs = _dequantize_q4_1(t.data).numpy(), gguf.quants.dequantize(t.data, t.tensor_type)
        assert ours.dtype == theirs.dtype == np.float32 and ours.size == theirs.size, t.name
        assert np.array_equal(ours.reshape(-1).view(np.uint32), theirs.reshape(-1).view(np.uint32)), t.name
