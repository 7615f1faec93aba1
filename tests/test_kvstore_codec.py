"""Serialisation: bit-identical round trips, every corruption is CorruptObject, lz4+shuffle."""

from __future__ import annotations

import lz4.block
import pytest
import torch

from pdserve.kvstore import codec

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64,
          torch.float8_e4m3fn]


def _sample(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).mul(10).to(dtype)


@pytest.mark.parametrize("name", ["none", "lz4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_identical(name, dtype):
    t = _sample(dtype)
    back = codec.decode(codec.encode(t, name))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2, 0, 3), (1, 1, 1, 1, 1, 1, 1, 2)])
def test_edge_shapes(shape):
    t = torch.ones(shape, dtype=torch.bfloat16)
    for name in codec.CODECS:
        assert torch.equal(codec.decode(codec.encode(t, name)), t)


def test_layout_starts_with_magic_and_never_pickles():
    blob = codec.encode(torch.zeros(4), "none")
    assert blob[:4] == codec.MAGIC and len(blob) == codec.HEADER_BYTES + 16
    assert b"torch" not in blob and b"\x80\x04" not in blob[:2]


@pytest.mark.parametrize("name", ["none", "lz4"])
def test_any_flipped_byte_or_truncation_is_corrupt(name):
    blob = codec.encode(_sample(torch.float16, (4, 8)), name)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        with pytest.raises(codec.CorruptObject):
            codec.decode(bytes(bad))
    for n in (0, 10, codec.HEADER_BYTES, len(blob) - 1):
        with pytest.raises(codec.CorruptObject):
            codec.decode(blob[:n])
    with pytest.raises(codec.CorruptObject):
        codec.decode(blob + b"\0")


def test_byte_shuffle_is_what_makes_lz4_pay_on_bf16():
    t = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    raw = bytes(codec.tensor_bytes(t))
    plain = len(lz4.block.compress(raw, store_size=False))
    shuffled = len(codec.encode(t, "lz4")) - codec.HEADER_BYTES
    assert shuffled < plain and shuffled < len(raw)


def test_unknown_codec_and_dtype_are_rejected():
    with pytest.raises(ValueError, match="--kv-codec"):
        codec.encode(torch.zeros(1), "zstd")
    with pytest.raises(ValueError, match="cannot store dtype"):
        codec.encode(torch.zeros(1, dtype=torch.complex64))
