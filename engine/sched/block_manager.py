"""The paged KV cache's block pool: free list, ref counts and the prefix cache. Pure Python.

Called by the ``Scheduler``, per request, in this order::

    blocks, n = get_computed_blocks(req)        # first schedule only: cached prefix (n tokens)
    allocate_slots(req, num_new, blocks)        # every step the request is scheduled
    cache_full_blocks(req, num_computed)        # after the runner wrote the KV
    free(req)                                   # finished, aborted or preempted

Free list, head to tail (``allocate_slots`` pops from the head)::

    [uncached free blocks ...][cached free blocks, least recently used first ...]

A freed block without a hash goes to the head (it holds nothing worth keeping); a freed block
with a hash goes to the tail and stays findable by its hash until it reaches the head and is
handed out again: that is the eviction, logged at DEBUG. A request's blocks are freed last
block first, so the tail of a prompt is evicted before its head. Only full blocks are hashed.
A request's ``cache_salt`` roots its chain (``hashing.salt_root``): requests with different salts
(or one with a salt and one without) never find each other's blocks.
With ``events`` set to a list, every hash registered, evicted or reset is recorded there for the node's KV
events (``engine.kv.kv_events``); the engine drains it with ``take_events`` after each step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from pdserve.engine.sched.hashing import extend_block_hashes
from pdserve.engine.sched.request import Request

logger = logging.getLogger(__name__)


class BlockIntegrityError(RuntimeError):
    """The pool's bookkeeping is inconsistent; the message names the block and both values."""


class PrefixCacheStats(NamedTuple):
    """Cumulative since start; unpacks as ``queries, hits``."""
    queries: int = 0   # tokens looked up (whole request length at each admission)
    hits: int = 0      # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks        # block -> its hash while cached
        self._cached: dict[int, int] = {}                         # hash -> block
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._owners: dict[str, Request] = {}                     # requests holding blocks
        self._num_registered: dict[str, int] = {}                 # request -> blocks whose hash is registered
        self.events: list[tuple] | None = None                    # a list: KV events are kept (``take_events``)
        self._stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks and its length in tokens; changes nothing.

        Never the whole request: the last token must be computed to get logits, so at most
        ``(num_tokens - 1) // block_size`` blocks (num_tokens = prompt + output after preemption). None for a
        request that computes its prompt logprobs (``Request.computes_prompt_logprobs``).
        """
        if not self.enable_prefix_caching or request.computes_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                     num_tokens=max_blocks * self.block_size, parent=request.block_hash_parent)
        blocks = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # ---- mutations -----------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] | None = None) -> bool:
        """Grow ``request.block_ids`` to hold ``num_computed_tokens + len(computed_blocks) *
        block_size + num_new_tokens`` tokens, taking a ref on ``computed_blocks`` first.

        Pass ``computed_blocks`` (the result of ``get_computed_blocks``, maybe empty) exactly once
        per admission, None afterwards; it also counts the prefix-cache query. Returns False and
        changes nothing when the free list is too short. The caller (the scheduler) then
        advances ``num_computed_tokens`` by the computed blocks' tokens.
        """
        computed = list(computed_blocks or ())
        if computed_blocks is not None and request.block_ids:
            raise ValueError(f"request {request.request_id!r} already holds {len(request.block_ids)} blocks; "
                             "computed_blocks are only given at its first schedule")
        owner = self._owners.get(request.request_id)
        if owner is not None and owner is not request:
            raise ValueError(f"another request with id {request.request_id!r} already holds blocks")
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - len(request.block_ids) - len(computed)
        touched_free = sum(1 for b in computed if self._ref[b] == 0)
        if num_new_blocks > len(self._free) - touched_free:
            return False
        for block in computed:
            self._take(block)
        request.block_ids.extend(computed)
        request.block_ids.extend(self._pop_free() for _ in range(num_new_blocks))
        self._owners[request.request_id] = request
        if computed_blocks is not None:
            self._num_registered[request.request_id] = len(computed)
            self._stats = PrefixCacheStats(self._stats.queries + request.num_tokens,
                                           self._stats.hits + len(computed) * self.block_size)
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the hashes of the blocks that ``num_tokens`` computed tokens fill.

        Called by the scheduler after each step. A block whose content is already cached in
        another block (two requests computed the same prefix) stays unregistered.
        """
        if not self.enable_prefix_caching:
            return
        done = self._num_registered.get(request.request_id, 0)
        full = min(num_tokens // self.block_size, len(request.block_ids))
        if full <= done:
            return
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                     num_tokens=full * self.block_size, parent=request.block_hash_parent)
        for i in range(done, full):
            block, h = request.block_ids[i], hashes[i]
            if h not in self._cached and self._hash[block] is None:
                self._cached[h] = block
                self._hash[block] = h
                if self.events is not None:
                    self.events.append(("stored", h))
        self._num_registered[request.request_id] = full

    def free(self, request: Request) -> None:
        """Drop the request's refs; blocks at ref 0 return to the free list. Idempotent."""
        for block in reversed(request.block_ids):
            self._ref[block] -= 1
            if self._ref[block] < 0:
                raise BlockIntegrityError(f"block {block} freed more often than taken "
                                          f"(ref {self._ref[block]}, request {request.request_id!r})")
            if self._ref[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)
        request.block_ids = []
        self._owners.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their KV); returns how many were dropped."""
        dropped = len(self._cached)
        for block in self._cached.values():
            self._hash[block] = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(("cleared",))
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        return dropped

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:
            logger.debug("evict block %d hash=%016x", block, h)
            del self._cached[h]
            self._hash[block] = None
            if self.events is not None:
                self.events.append(("removed", h))
        self._ref[block] = 1
        return block

    def take_events(self) -> list[tuple]:
        """The KV events since the last call, oldest first (``engine.kv.kv_events``); [] when not kept."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    # ---- checks --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``BlockIntegrityError`` naming the first inconsistency found. O(num_blocks).

        Ref counts equal the number of live block tables holding each block; a block is free
        exactly when its ref is 0; hash map and per-block hashes agree, and each registered
        block's hash is the hash of the tokens its request holds there.
        """
        expected = [0] * self.num_blocks
        for rid, req in self._owners.items():
            self._check_request(rid, req)
            for b in req.block_ids:
                expected[b] += 1
        for b in range(self.num_blocks):
            if self._ref[b] != expected[b]:
                _fail(f"block {b} has ref {self._ref[b]} but {expected[b]} live block tables hold it")
            if (b in self._free) != (self._ref[b] == 0):
                where = "in" if b in self._free else "not in"
                _fail(f"block {b} has ref {self._ref[b]} and is {where} the free list")
        if len(self._free) != expected.count(0):
            _fail(f"free list has {len(self._free)} entries but {expected.count(0)} blocks have ref 0")
        for h, b in self._cached.items():
            if self._hash[b] != h:
                _fail(f"hash {h:016x} maps to block {b}, whose hash is {self._hash[b]}")
        num_hashed = self.num_blocks - self._hash.count(None)
        if num_hashed != len(self._cached):
            _fail(f"{num_hashed} blocks carry a hash but the hash map has {len(self._cached)} entries")

    def _check_request(self, rid: str, req: Request) -> None:
        if req.request_id != rid:
            _fail(f"owner entry {rid!r} holds request {req.request_id!r}")
        if len(set(req.block_ids)) != len(req.block_ids):
            _fail(f"request {rid!r} holds a block twice: {req.block_ids}")
        if req.num_computed_tokens > len(req.block_ids) * self.block_size:
            _fail(f"request {rid!r} computed {req.num_computed_tokens} tokens but holds only "
                  f"{len(req.block_ids)} blocks of {self.block_size}")
        for i in range(self._num_registered.get(rid, 0)):
            h = self._hash[req.block_ids[i]]
            if h is not None and h != req.block_hashes[i]:
                _fail(f"request {rid!r} block {i} (id {req.block_ids[i]}) is cached as {h:016x} "
                      f"but its tokens hash to {req.block_hashes[i]:016x}")


def _fail(message: str) -> None:
    raise BlockIntegrityError(message)
