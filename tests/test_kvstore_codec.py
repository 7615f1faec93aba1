"""Serialisation: bit-identical round trips, every corruption is CorruptObject, the header names
the key it was written for (KeyMismatch), lz4+shuffle."""

from __future__ import annotations

import lz4.block
import pytest
import torch
import xxhash

from pdserve.kvstore import codec

KEY = "chunk0:0"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64,
          torch.float8_e4m3fn]


def _sample(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).mul(10).to(dtype)


@pytest.mark.parametrize("name", ["none", "lz4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_identical(name, dtype):
    t = _sample(dtype)
    back = codec.decode(codec.encode(t, name, KEY), KEY)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2, 0, 3), (1, 1, 1, 1, 1, 1, 1, 2)])
def test_edge_shapes(shape):
    t = torch.ones(shape, dtype=torch.bfloat16)
    for name in codec.CODECS:
        assert torch.equal(codec.decode(codec.encode(t, name, KEY), KEY), t)


def test_layout_starts_with_magic_and_never_pickles():
    blob = codec.encode(torch.zeros(4), "none", KEY)
    assert blob[:4] == codec.MAGIC and len(blob) == codec.HEADER_BYTES + 16 and codec.HEADER_BYTES == 108
    assert int.from_bytes(blob[4:6], "little") == codec.FORMAT_VERSION == 3 and blob[9] == 0     # not sealed
    assert int.from_bytes(blob[76:84], "little") == xxhash.xxh3_64_intdigest(KEY.encode())
    assert blob[codec.HEADER_BYTES:] == torch.zeros(4).numpy().tobytes()     # header + raw bytes, nothing else


def test_no_store_path_unpickles(monkeypatch, tmp_path):
    """Every decode path runs with pickle and torch.load disabled (they raise if anything calls them)."""
    import pickle

    from pdserve.kvstore.disk import DiskTier
    from pdserve.kvstore.memory import MemoryTier
    from pdserve.kvstore.auth import process_key
    from pdserve.kvstore.seal import seal, unseal
    from pdserve.kvstore.tiered import TieredStore

    def forbidden(*a, **k):
        raise AssertionError("unpickling on a store path")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    t = _sample(torch.bfloat16, (2, 3, 4))
    for name in ("none", "lz4"):
        assert torch.equal(codec.decode(codec.encode(t, name, KEY), KEY).view(torch.uint8), t.view(torch.uint8))
    obj, _ = seal(KEY, t, process_key().seal_key)
    store = TieredStore(MemoryTier(1), [DiskTier(tmp_path, 1 << 20)])            # L1 too small: disk serves
    try:
        store.put([(KEY, obj)])
        assert store.flush()
        got = store.get([KEY])[0]
        assert torch.equal(unseal(KEY, got, process_key().seal_key)[0].view(torch.uint8), t.view(torch.uint8))
    finally:
        store.close()


@pytest.mark.parametrize("name", ["none", "lz4"])
def test_any_flipped_byte_or_truncation_is_corrupt(name):
    blob = codec.encode(_sample(torch.float16, (4, 8)), name, KEY)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        with pytest.raises(codec.CorruptObject):
            codec.decode(bytes(bad), KEY)
    for n in (0, 10, codec.HEADER_BYTES, len(blob) - 1):
        with pytest.raises(codec.CorruptObject):
            codec.decode(blob[:n], KEY)
    with pytest.raises(codec.CorruptObject):
        codec.decode(blob + b"\0", KEY)


@pytest.mark.parametrize("name", ["none", "lz4"])
def test_object_read_under_another_key_is_a_key_mismatch(name):
    """Catches: the header named no key, so a value copied or misplaced under another key
    decoded as a valid object of that key (format 1 had no key hash)."""
    blob = codec.encode(_sample(torch.bfloat16), name, KEY)
    with pytest.raises(codec.KeyMismatch, match="written for another key"):
        codec.decode(blob, "chunk1:0")
    assert issubclass(codec.KeyMismatch, codec.CorruptObject)


def test_version_1_objects_are_corrupt_not_misread():
    blob = bytearray(codec.encode(torch.zeros(4), "none", KEY))
    blob[4:6] = (1).to_bytes(2, "little")
    with pytest.raises(codec.CorruptObject, match="version"):
        codec.decode(bytes(blob), KEY)


def _as_format_2(blob: bytes, flags: int = 0) -> bytes:
    """``blob`` as a format 2 writer (nodes before the flags byte) made it: version 2, byte 9 ``flags`` (padding, 0
    there), the checksum over that header and the whole payload."""
    b = bytearray(blob)
    b[4:6], b[9] = (2).to_bytes(2, "little"), flags
    payload = bytes(b[codec.HEADER_BYTES:])
    b[100:108] = codec._checksum(bytes(b[:100]), payload).to_bytes(8, "little")
    return bytes(b)


@pytest.mark.parametrize("name", ["none", "lz4"])
def test_format_2_objects_are_still_read(name):
    """Catches: format 3 made every object an older node wrote a corrupt miss, deleted -- nodes upgraded one by
    one would delete their peers' KV."""
    t = _sample(torch.bfloat16)
    assert torch.equal(codec.decode(_as_format_2(codec.encode(t, name, KEY)), KEY), t)
    with pytest.raises(codec.CorruptObject, match="format 2"):
        codec.decode(_as_format_2(codec.encode(t, name, KEY), flags=1), KEY)


def test_byte_shuffle_is_what_makes_lz4_pay_on_bf16():
    t = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    raw = bytes(codec.tensor_bytes(t))
    plain = len(lz4.block.compress(raw, store_size=False))
    shuffled = len(codec.encode(t, "lz4", KEY)) - codec.HEADER_BYTES
    assert shuffled < plain and shuffled < len(raw)


def test_unknown_codec_and_dtype_are_rejected():
    with pytest.raises(ValueError, match="--kv-codec"):
        codec.encode(torch.zeros(1), "zstd", KEY)
    with pytest.raises(ValueError, match="cannot store dtype"):
        codec.encode(torch.zeros(1, dtype=torch.complex64), "none", KEY)


def test_only_a_sealed_object_for_its_key_is_flagged_and_its_checksum_skips_the_payload():
    """FLAG_SEALED: set for a 1-D uint8 tensor ``sealed_for`` accepts with codec "none" only; the checksum then
    covers header + seal head, so a payload byte past the head still decodes (the loader's MAC refuses it)."""
    from pdserve.kvstore.seal import seal, sealed_for

    obj = seal(KEY, torch.arange(64, dtype=torch.float32), b"k" * 32)[0]
    blob = codec.encode(obj, "none", KEY, sealed_for)
    assert blob[9] == codec.FLAG_SEALED
    assert codec.encode(obj, "lz4", KEY, sealed_for)[9] == 0
    assert codec.encode(obj, "none", "chunk9:0", sealed_for)[9] == 0          # laid out for another key
    assert codec.encode(obj.view(torch.int32), "none", KEY, lambda k, p: True)[9] == 0   # not a 1-D uint8 tensor
    bad, at = bytearray(blob), codec.HEADER_BYTES + codec.SEALED_HEAD + 3
    bad[at] ^= 1
    assert codec.decode(bytes(bad), KEY, sealed_for=sealed_for)[codec.SEALED_HEAD + 3] == bad[at] != blob[at]
    with pytest.raises(codec.CorruptObject, match="flagged sealed"):
        codec.decode(blob, KEY)                                              # a reader that cannot check it
    lz4_flagged = bytearray(codec.encode(obj, "lz4", KEY))
    lz4_flagged[9] = codec.FLAG_SEALED
    with pytest.raises(codec.CorruptObject, match="flags"):
        codec.decode(bytes(lz4_flagged), KEY, sealed_for=sealed_for)
