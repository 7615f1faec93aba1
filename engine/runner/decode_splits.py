"""The split-K count of decode steps on the Triton backend: one rule for CUDA-graph replay and eager steps.

Built once by ``ModelRunner`` (Triton backend only); ``ModelRunner.execute`` calls ``apply(meta)`` on every
step's metadata, and ``DecodeGraphs`` captures bucket ``b`` with ``for_bucket(b)``:

    rule = DecodeSplits(max_num_seqs, max_model_len, num_kv_heads)
    rule.apply(meta)     # a decode-only step of B rows -> meta.num_splits = for_bucket(bucket(B))

A graph fixes its split count at capture, before any step's lengths are known; the count sets the kernel's
summation order. So an eager decode step (``--enforce-eager``, or graphs off) plans from the bucket its batch
would replay in, never from its own ``max_seq_len``: the same step gives the same bits either way
(``kernels/split_k.py`` holds the numbers). Prefill and mixed steps are never replayed; the kernel plans them.
"""

from __future__ import annotations

from pdserve.kernels.split_k import decode_splits


def buckets(max_num_seqs: int) -> list[int]:
    """The CUDA-graph batch sizes: 1, 2, 4, then multiples of 8 up to ``max_num_seqs`` (vLLM's shape)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeSplits:
    def __init__(self, max_num_seqs: int, max_model_len: int, num_kv_heads: int):
        self.sizes = buckets(max_num_seqs)
        self.max_model_len, self.num_kv_heads = max_model_len, num_kv_heads

    def bucket(self, num_seqs: int) -> int:
        """The graph bucket a batch of ``num_seqs`` decode rows replays in (itself past the largest)."""
        return next((s for s in self.sizes if s >= num_seqs), num_seqs)

    def for_bucket(self, bucket: int) -> int:
        return decode_splits(bucket, self.num_kv_heads, self.max_model_len)

    def apply(self, meta) -> None:
        """Fix ``meta.num_splits`` for a decode-only step on the Triton backend; leave other steps alone."""
        if meta.backend == "triton" and meta.is_decode_only:
            meta.num_splits = self.for_bucket(self.bucket(meta.num_seqs))
