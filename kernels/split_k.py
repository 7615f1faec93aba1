"""How many key splits (split-K) a Triton attention launch uses: host ints in, an int out, no triton import.

Called by ``triton_attention.plan_attention`` for a launch whose metadata fixes no count (prefill and mixed
steps: ``splits_for(programs, max_seq_len)``), and by the runner for every decode step on the Triton backend,
CUDA graph or eager alike (``engine/runner/decode_splits.py``: ``decode_splits(bucket, Hkv, max_model_len)``).

    programs = query blocks x KV heads; fewer than TARGET_PROGRAMS -> split each program's keys
    splits   = min(cdiv(TARGET_PROGRAMS, programs), max_keys // MIN_SPLIT_KEYS, MAX_SPLITS), at least 1

A decode step's count depends only on its graph bucket, the KV-head count and ``--max-model-len`` (all fixed
at capture), never on the step's own lengths: the split count sets the kernel's summation order, so a rule
that read ``max_seq_len`` gave a replayed step and the same step run eagerly different last bits.
"""

from __future__ import annotations

TARGET_PROGRAMS = 264      # ~2 waves of programs on a 132-SM H200; fewer programs than this -> split K
MIN_SPLIT_KEYS = 256       # a split below this many keys costs more in the reduce than it saves
MAX_SPLITS = 32


def splits_for(programs: int, max_keys: int) -> int:
    """Splits for ``programs`` attention programs whose longest key range is ``max_keys`` keys."""
    by_len = max(1, max_keys // MIN_SPLIT_KEYS)
    return max(1, min(-(-TARGET_PROGRAMS // max(1, programs)), by_len, MAX_SPLITS))


def decode_splits(bucket: int, num_kv_heads: int, max_model_len: int) -> int:
    """Splits of a decode step padded to ``bucket`` rows: one program per (row, KV head) does work."""
    return splits_for(bucket * num_kv_heads, max_model_len)
