"""A daemon's TCP batches (kvstore/client_segment.py): split into parts, checked in one pass per reply.

What is pinned here: a batch of mixed objects -- sealed ones on either side of the client's copy threshold
(``client.COPY_BELOW``), typed tensors of several dtypes and ranks, a tiny plain uint8 one, a miss -- comes back
bit-identical with its dtype and shape whatever the part boundaries (``PART_BYTES`` for puts, ``GET_PARTS`` for
gets); a Get reply whose payload frames do not pair with its metas is refused as a whole (``DaemonError``), never
read off by one; the one-step paths of ``nbytes_of`` still refuse what ``check_meta`` refused.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore_fixtures import TOKEN
from pdserve.kvstore import client_segment
from pdserve.kvstore import protocol as P
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.client import COPY_BELOW, DaemonClient, DaemonError
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.daemon import KVDaemon
from pdserve.kvstore.seal import SEAL_BYTES, seal, unseal

SEAL_KEY = ClusterKey(TOKEN).seal_key


class FrameDroppingDaemon(KVDaemon):
    """Answers every Get with one payload frame fewer than its metas name (``extra``: one more)."""

    extra = False

    def _get(self, req, ident, frames):
        reply, payload = super()._get(req, ident, frames)
        return reply, (payload + payload[:1] if self.extra else payload[:-1])


@pytest.fixture
def served():
    daemons = []

    def start(cls=KVDaemon) -> KVDaemon:
        daemon = cls(build_store(KVStoreConfig(cpu_bytes=64 << 20), arena=True), port=0, token=TOKEN)
        stop = threading.Event()
        thread = threading.Thread(target=daemon.serve, args=(stop,))
        thread.start()
        daemons.append((daemon, stop, thread))
        return daemon
    yield start
    for daemon, stop, thread in daemons:
        stop.set()
        thread.join()
        daemon.close()
        daemon.store.close()


def _sealed(key: str, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(key) + nbytes)
    return seal(key, torch.randint(0, 255, ((nbytes - SEAL_BYTES),), dtype=torch.uint8, generator=g), SEAL_KEY)[0]


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    items = [(f"s{n}-{i}:0", _sealed(f"s{n}-{i}:0", n)) for n in (64 << 10, COPY_BELOW - 1, COPY_BELOW,
                                                               COPY_BELOW + 64, 1 << 20) for i in range(3)]
    items += [("f32:0", torch.randn(33, 17, generator=g)),
              ("bf16:0", torch.randn(2, 3, 4096, generator=g).to(torch.bfloat16)),
              ("i64:0", torch.arange(-5, 5, dtype=torch.int64)),
              ("u8:0", torch.arange(10, dtype=torch.uint8)),                    # plain uint8 1-D, not sealed
              ("u8x2:0", torch.arange(12, dtype=torch.uint8).reshape(3, 4))]
    return items


@pytest.mark.parametrize("part_bytes,get_parts", [(4 << 20, 8), (200 << 10, 3), (1, 1), (1 << 30, 100)])
def test_a_mixed_batch_round_trips_bit_identical_at_any_part_boundary(served, monkeypatch, part_bytes, get_parts):
    monkeypatch.setattr(client_segment, "PART_BYTES", part_bytes)
    monkeypatch.setattr(client_segment, "GET_PARTS", get_parts)
    daemon, items = served(), _mixed()
    with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as client:
        client.put(items)
        keys = [k for k, _ in items]
        got = client.get(keys[:5] + ["missing:0"] + keys[5:])
        assert got[5] is None
        got = got[:5] + got[6:]
        for (key, want), have in zip(items, got):
            assert have is not None and have.dtype == want.dtype and have.shape == want.shape, key
            assert torch.equal(have, want), key
            if key.startswith("s"):
                unseal(key, have, SEAL_KEY)                 # the loader's check holds on what came back
        stats = client.stats()["client"]
        assert stats["frame_objects"] == 2 * len(items) and stats["checksum_failures"] == 0


@pytest.mark.parametrize("extra", [False, True], ids=["a frame short", "a frame over"])
def test_a_get_reply_whose_frames_do_not_pair_with_its_metas_is_refused(served, extra):
    daemon = served(type("D", (FrameDroppingDaemon,), {"extra": extra}))
    items = [(f"k{i}:0", _sealed(f"k{i}:0", 4096)) for i in range(4)]
    with DaemonClient(daemon.endpoint, token=TOKEN, timeout_s=20) as client:
        client.put(items)
        with pytest.raises(DaemonError, match="frames for"):
            client.get([k for k, _ in items])


def test_the_one_step_size_paths_refuse_what_check_meta_refused():
    assert P.nbytes_of(P.ObjMeta("k:0", "uint8", [10], 10)) == 10
    assert P.nbytes_of(P.ObjMeta("k:0", "uint8", [-10], -10)) == -1
    with pytest.raises(ValueError, match="negative"):
        P.check_meta(P.ObjMeta("k:0", "uint8", [-10], -10), 1 << 20)
    with pytest.raises(ValueError, match="does not match"):
        P.check_meta(P.ObjMeta("k:0", "uint8", [10], 11), 1 << 20)
    with pytest.raises(ValueError, match="limit"):
        P.check_meta(P.ObjMeta("k:0", "uint8", [2 << 20], 2 << 20), 1 << 20)
