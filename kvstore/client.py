"""``DaemonClient``: the ``KVStore`` interface over a store daemon (``--kv-store tcp://...``).

Who calls it: an engine whose store lives in another process, the bench, tests.
Requests go one at a time (a lock) over a zmq DEALER; replies are matched by id, so a
reply that arrives after a timeout is discarded. With ``shm_bytes > 0`` (daemon on the
same host) payloads travel through a shared-memory segment and zmq carries headers only;
an object larger than the segment falls back to a zmq frame. Batches are split to the
daemon's limits. Daemon errors raise ``DaemonError``; a silent daemon raises
``TimeoutError`` naming the URL -- the caller (engine) treats both as a store miss.
"""

from __future__ import annotations

import itertools
import secrets
import threading

import numpy as np
import torch
import zmq

from pdserve.kvstore import protocol as P
from pdserve.kvstore.base import KVStore, StatsDict
from pdserve.kvstore.codec import tensor_bytes
from pdserve.kvstore.keys import check_key
from pdserve.kvstore.shm import ShmSegment, align


class DaemonError(RuntimeError):
    """The daemon answered ``ok=False``; the message is its reason."""


class DaemonClient(KVStore):
    name = "daemon"

    def __init__(self, url: str, token: str = "", shm_bytes: int = 0, timeout_s: float = 30.0,
                 max_batch: int = 1024) -> None:
        self.url, self.token, self.timeout_ms, self.max_batch = url, token, int(timeout_s * 1000), max_batch
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._seg: ShmSegment | None = None
        if shm_bytes:
            self._attach(shm_bytes)

    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        batch: list[tuple[P.ObjMeta, memoryview | None]] = []
        offset = 0
        for key, tensor in items:
            meta = P.meta_of(check_key(key), tensor)
            full = len(batch) >= self.max_batch
            fits = self._seg is not None and meta.nbytes <= self._seg.size
            if full or (fits and offset + meta.nbytes > self._seg.size):
                self._send_put(batch)
                batch, offset = [], 0
            if fits:
                self._seg.write(offset, tensor)
                meta.offset, offset = offset, align(offset + meta.nbytes)
            batch.append((meta, None if fits else tensor_bytes(tensor)))
        if batch:
            self._send_put(batch)

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        return [t for b in self._batches(keys) for t in self._get_batch(b)]

    def contains(self, keys: list[str]) -> list[bool]:
        return [p for b in self._batches(keys) for p in self._request(P.Contains(keys=b))[0].present]

    def lookup(self, chunk_keys: list[str], num_layers: int) -> int:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        return self._request(P.Lookup(chunk_keys=chunk_keys, num_layers=num_layers))[0].count

    def delete(self, keys: list[str]) -> None:
        for b in self._batches(keys):
            self._request(P.Delete(keys=b))

    def stats(self) -> StatsDict:
        return self._request(P.Stats())[0].stats

    def ping(self) -> bool:
        return self._request(P.Ping())[0].ok

    def close(self) -> None:
        if self._sock.closed:
            return
        if self._seg is not None:
            try:
                self.timeout_ms = min(self.timeout_ms, 1000)
                self._request(P.Detach())
            except (TimeoutError, DaemonError):
                pass
            self._seg.close()
        self._sock.close(linger=0)
        self._ctx.term()

    def _attach(self, shm_bytes: int) -> None:
        seg = ShmSegment.create(shm_bytes)
        try:
            self._request(P.Attach(path=str(seg.path), size=shm_bytes))
        finally:
            seg.unlink()        # both sides hold the mapping; the name is no longer needed
        self._seg = seg

    def _send_put(self, batch: list[tuple[P.ObjMeta, memoryview | None]]) -> None:
        frames = [payload for _, payload in batch if payload is not None]
        self._request(P.Put(objs=[meta for meta, _ in batch]), frames)

    def _get_batch(self, keys: list[str]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(keys)
        todo, use_shm = list(range(len(keys))), self._seg is not None
        while todo:
            reply, frames = self._request(P.Get(keys=[keys[i] for i in todo], shm=use_shm))
            frames, deferred = iter(frames), []
            for i, meta in zip(todo, reply.objs):
                if meta is not None and meta.offset == P.DEFERRED:
                    deferred.append(i)
                elif meta is not None:
                    out[i] = self._payload(meta, frames)
            use_shm = use_shm and len(deferred) < len(todo)   # nothing fit: fall back to frames
            todo = deferred
        return out

    def _payload(self, meta: P.ObjMeta, frames) -> torch.Tensor:
        if meta.offset == P.FRAME:
            raw = torch.empty(meta.nbytes, dtype=torch.uint8)
            raw.numpy()[:] = np.frombuffer(next(frames).buffer, dtype=np.uint8)
        else:
            raw = self._seg.read(meta.offset, meta.nbytes)
        return raw.view(P.dtype_of(meta.dtype)).reshape(meta.shape)

    def _batches(self, keys: list[str]):
        for key in keys:
            check_key(key)
        return [keys[i:i + self.max_batch] for i in range(0, len(keys), self.max_batch)]

    def _request(self, req, frames=()) -> tuple[P.Reply, list]:
        with self._lock:
            req.id, req.token = next(self._ids), self.token
            self._sock.send_multipart([P.ENCODER.encode(req), *frames], copy=False)
            while True:
                if not self._sock.poll(self.timeout_ms):
                    raise TimeoutError(f"KV daemon at {self.url} did not answer {type(req).__name__} "
                                       f"within {self.timeout_ms} ms")
                reply_frames = self._sock.recv_multipart(copy=False)
                reply = P.REPLY_DECODER.decode(reply_frames[0].buffer)
                if reply.id == req.id:
                    break
        if not reply.ok:
            raise DaemonError(f"KV daemon at {self.url}: {reply.error}")
        return reply, reply_frames[1:]
