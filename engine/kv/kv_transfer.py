"""``kv_transfer_params``: what a prefill node returns and a decode node receives (via the proxy).

The proxy treats it as opaque JSON. Both nodes check that they agree on everything that shapes KV
bytes; a mismatch is refused naming both values, never loaded as wrong KV.

    proxy -> prefill   {"do_remote_decode": true}
    prefill -> proxy   {"do_remote_prefill": true, "version": 1, "model_fingerprint": ..., "block_size": 16,
                        "chunk_tokens": 256, "kv_layout": ..., "num_tokens": 300, "chunk_keys": [...],
                        "chunk_digests": [...], "first_token_id": 42, "first_token_logprob": -0.3,
                        "first_token_top_logprobs": [[42, -0.3], ...], "sampler_draws": 1, "accounting": {...},
                        "prompt_logprobs": [[id, logprob, rank, [[id, logprob], ...]], ...]   (when asked)}
    proxy -> decode    the same object; the decode node starts from prompt + first_token_id

The sampling fields make the decode node's answer the one a colocated node gives: the first token's
logprobs (emitted by the decode node as its own first token's), and ``sampler_draws``, the draws the
prefill node's seeded sampling made, the index of the decode node's first draw (``runner/seeded.py``).
``prompt_logprobs`` (a request that asked for them, or for ``echo`` with ``logprobs``): the prefill node ran the
prompt, so its figures are the answer's; the decode node, which loads the prompt's KV and computes no logits for it,
checks them against the prompt (``prompt_logprobs_for``) and emits them with the first token.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from pdserve.engine.outputs import PromptLogprob

TRANSFER_VERSION = 1
TopLogprobs = Annotated[list[tuple[int, float]], msgspec.Meta(max_length=20)]   # SamplingParams.logprobs <= 20
Draws = Annotated[int, msgspec.Meta(ge=0, le=4096)]   # a prefill node samples one token; skipping is O(vocab) each
Digest = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{0,16}$")]            # kvstore.seal.chunk_digest
Digests = Annotated[list[Digest], msgspec.Meta(max_length=1 << 16)]
PromptLogprobs = Annotated[list[PromptLogprob], msgspec.Meta(max_length=1 << 20)]   # protocol.MAX_TOKEN_IDS


class TransferMismatchError(ValueError):
    """Prefill and decode disagree on something that shapes the KV bytes."""


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    version: int = TRANSFER_VERSION
    model_fingerprint: str | None = None
    block_size: int | None = None
    chunk_tokens: int | None = None
    kv_layout: str | None = None
    num_tokens: int = 0                       # prompt tokens whose KV was published
    chunk_keys: list[str] = []
    chunk_digests: Digests = []             # per published chunk: seal digest of its layers ("" = unknown)
    first_token_id: int | None = None
    first_token_logprob: float | None = None
    first_token_top_logprobs: TopLogprobs | None = None
    sampler_draws: Draws = 0                  # draws the prefill node's seeded sampling made
    accounting: dict[str, int] | None = None
    prompt_logprobs: PromptLogprobs | None = None   # prompt tokens 1.. (the prefill node's, when asked for)

    @classmethod
    def from_json_obj(cls, obj) -> "KVTransferParams":
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise TransferMismatchError(f"kv_transfer_params is malformed: {exc}") from None

    def to_json_obj(self) -> dict:
        return msgspec.to_builtins(self)

    def check_first_token(self, vocab_size: int) -> None:
        """The prefill node's first token, as the decode node will emit it: a token the model cannot have would
        fail the whole step it is batched in, an id or logprob that cannot be written out would fail its reply."""
        ids = ([] if self.first_token_id is None else [("first_token_id", self.first_token_id)]) + \
            [("first_token_top_logprobs id", i) for i, _ in self.first_token_top_logprobs or ()]
        for name, i in ids:
            if not 0 <= i < vocab_size:
                raise TransferMismatchError(f"kv_transfer_params.{name} {i} is outside the vocabulary "
                                            f"[0, {vocab_size})")
        lps = ([] if self.first_token_logprob is None else [self.first_token_logprob]) + \
            [lp for _, lp in self.first_token_top_logprobs or ()]
        if any(math.isnan(lp) or lp > 0 for lp in lps):
            raise TransferMismatchError(f"kv_transfer_params logprobs must be <= 0 (a log-probability), got {lps}")

    def prompt_logprobs_for(self, prompt_ids: list[int], vocab_size: int, k: int) -> list[PromptLogprob]:
        """The prefill node's prompt logprobs for ``prompt_ids``, top lists cut to ``k``; raises naming what does
        not fit: none sent, a length or a token other than the prompt's, an id outside the vocabulary, a logprob
        that is not one, a rank below 1 (more than 20 top entries fail at decoding: ``PromptLogprob.top``)."""
        got = self.prompt_logprobs
        if got is None:
            raise TransferMismatchError("the request asks for prompt logprobs but kv_transfer_params carries none; "
                                        "the prefill node computes them (send the same request body to both)")
        if len(got) != len(prompt_ids) - 1 or any(e.token_id != t for e, t in zip(got, prompt_ids[1:])):
            raise TransferMismatchError(f"kv_transfer_params.prompt_logprobs has {len(got)} entries that do not "
                                        f"follow the prompt's {len(prompt_ids) - 1} tokens after the first")
        for e in got:
            lps, ids = [e.logprob, *(lp for _, lp in e.top)], [i for i, _ in e.top]
            if e.rank < 1 or any(not 0 <= i < vocab_size for i in ids) or \
                    any(math.isnan(lp) or lp > 0 for lp in lps):
                raise TransferMismatchError(f"kv_transfer_params.prompt_logprobs entry {e!r:.200} is not a prompt "
                                            f"logprob (rank >= 1, ids in [0, {vocab_size}), logprobs <= 0)")
        return [e if len(e.top) <= k else PromptLogprob(e.token_id, e.logprob, e.rank, e.top[:k]) for e in got]

    def check_compatible(self, *, fingerprint: str, block_size: int, chunk_tokens: int, kv_layout: str) -> None:
        """Raise naming both values when the prefill node's KV cannot be read here."""
        if self.version != TRANSFER_VERSION:
            raise TransferMismatchError(f"kv_transfer_params version {self.version}; this node reads "
                                        f"{TRANSFER_VERSION}")
        for name, theirs, ours in (("kv_layout", self.kv_layout, kv_layout),
                                   ("block_size", self.block_size, block_size),
                                   ("chunk_tokens", self.chunk_tokens, chunk_tokens),
                                   ("model_fingerprint", self.model_fingerprint, fingerprint)):
            if theirs is not None and theirs != ours:
                raise TransferMismatchError(f"prefill node has {name}={theirs!r} but this decode node has "
                                            f"{name}={ours!r}; run both with the same model, --dtype, "
                                            f"--block-size and --kv-chunk-tokens")


def check_transfer(kv_transfer_params: dict | None, vocab_size: int, check_store) -> None:
    """Raise ``TransferMismatchError`` if a node cannot use these ``kv_transfer_params``; ``check_store`` compares
    them with the node's KV store (``None``: the node has none). Shared by ``LLMEngine`` and the engine-core client."""
    if not kv_transfer_params:
        return
    transfer = KVTransferParams.from_json_obj(kv_transfer_params)
    transfer.check_first_token(vocab_size)
    if transfer.do_remote_prefill:
        if check_store is None:
            raise TransferMismatchError("kv_transfer_params asks to load remote KV but this node has no KV "
                                        "store; start it with --role decode --kv-store tcp://HOST:PORT")
        check_store(transfer)
