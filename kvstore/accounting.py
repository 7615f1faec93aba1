"""Per-request KV accounting: how many prompt tokens were cached, loaded, recomputed.

Who calls it: the decode node (and a ``both`` node with a store) once per request after
its store lookup, then again with ``with_loaded`` when the load finished or failed. The
result is logged once at INFO (``log_line``), exported as metrics and returned in
``kv_transfer_params``. It fixes LMCache's ``need to load: -128``:

    prompt  |<------------------------ total ------------------------>|
    local   |<---- local_hit ---->|                      (own prefix cache)
    store   |<------------- store_hit ------------->|    (leading chunks in the store)
    load                          |<- need_to_load ->|   whole blocks, clamped to >= 0,
                                                          never the last prompt token
    need_to_load = floor_blocks(max(0, min(store_hit, total - 1) - local_hit))
    local_hit + loaded + recomputed == total; a failed load is recomputed.

A request that finished or was aborted before the scheduler admitted it (a decode request ended by
the prefill node's token: max_tokens 1, or that token was eos or a stop) accounted for no KV here:
``not_run()``, every figure 0 (total too, so the sum rule and the node's totals hold), ``ran`` False --
not its prompt "recomputed".
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVAccounting:
    total_tokens: int
    local_hit_tokens: int
    store_hit_tokens: int
    need_to_load: int
    loaded_tokens: int
    recomputed_tokens: int
    ran: bool = True                  # False: never admitted, nothing looked up, loaded or computed

    def with_loaded(self, loaded_tokens: int) -> "KVAccounting":
        """The record after the load: ``loaded_tokens`` arrived (0 when the load failed)."""
        _check_range("loaded_tokens", loaded_tokens, self.need_to_load, "need_to_load")
        recomputed = self.total_tokens - self.local_hit_tokens - loaded_tokens
        return replace(self, loaded_tokens=loaded_tokens, recomputed_tokens=recomputed)

    def log_line(self) -> str:
        if not self.ran:
            return "not run (finished or aborted before it was scheduled: no KV looked up, loaded or computed)"
        return (f"total={self.total_tokens} local_hit={self.local_hit_tokens} store_hit={self.store_hit_tokens} "
                f"need_to_load={self.need_to_load} loaded={self.loaded_tokens} "
                f"recomputed={self.recomputed_tokens}")


def not_run() -> KVAccounting:
    """The record of a request that never reached the scheduler's admission: nothing hit, loaded or computed."""
    return KVAccounting(0, 0, 0, 0, 0, 0, ran=False)


def account(total_tokens: int, local_hit_tokens: int, store_hit_tokens: int, block_size: int,
            loaded_tokens: int | None = None) -> KVAccounting:
    """The plan for one request; ``loaded_tokens`` defaults to ``need_to_load`` (a full load)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size} (--block-size)")
    _check_range("total_tokens", total_tokens, None, "")
    _check_range("local_hit_tokens", local_hit_tokens, total_tokens, "total_tokens")
    _check_range("store_hit_tokens", store_hit_tokens, None, "")
    loadable = max(0, min(store_hit_tokens, total_tokens - 1) - local_hit_tokens)
    need = loadable // block_size * block_size
    plan = KVAccounting(total_tokens, local_hit_tokens, store_hit_tokens, need, 0, 0)
    return plan.with_loaded(need if loaded_tokens is None else loaded_tokens)


def _check_range(name: str, value: int, upper: int | None, upper_name: str) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if upper is not None and value > upper:
        raise ValueError(f"{name}={value} exceeds {upper_name}={upper}")
