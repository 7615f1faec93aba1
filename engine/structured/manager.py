"""Per-request grammar state in the engine core: compile, wait, mask, advance, finish.

Owned by ``LLMEngine`` and called by its ``Scheduler`` (``grammars``) and by ``LLMEngine.step``:

    manager.check(spec)                LLMEngine.add_request: a schema that is not JSON is refused at once

    manager.add(req)                   Scheduler.add_request: the request's constraint is submitted for
                                       compiling; the request waits in WAITING_FOR_GRAMMAR, outside the queue
    manager.poll(req) -> bool          Scheduler.schedule, each step: True once compiled (it then joins the
                                       waiting queue); raises StructuredOutputError if the compile failed
                                       (that request finishes aborted with the reason, nobody else notices)
    manager.bitmask(scheduled)         LLMEngine.step, before the model runs: one row per structured request
                                       that samples this step (``GrammarBitmask``), applied by the runner; a
                                       request still short of ``min_tokens`` whose constraint allows nothing
                                       but its end gets ``grammar_ends`` (eos no longer banned: it ends, valid)
    manager.accept(req, token) -> bool Scheduler.update_from_output, per sampled token: advances the matcher;
                                       True when the constraint is complete (its stop token was accepted): the
                                       request finishes with "stop"
    manager.release(request_id)        when the request finishes or is aborted

A request that continues another node's (disaggregated decode) already holds the prefill node's first token:
its matcher accepts it when it is made, before the first decode sample, so both nodes constrain the same
sequence. The matcher follows output tokens only, so a preempted request (recomputed later) keeps its state.
"""

from __future__ import annotations

import logging

import numpy as np

from pdserve.engine.structured.bitmask import GrammarBitmask
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.grammar import KIND_NAMES, StructuredOutputError

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int):
        self.compiler, self.vocab_size = compiler, vocab_size
        self._compiles: dict[str, object] = {}     # request id -> Future[CompiledGrammar]
        self._matchers: dict[str, object] = {}     # request id -> xgrammar.GrammarMatcher

    @staticmethod
    def check(spec) -> None:
        """Raise ValueError if ``spec`` cannot even be named (a schema that is not JSON text); compiling it tells
        the rest, later, off the caller's thread."""
        try:
            _ = spec.key                                # parses a schema's JSON text
        except ValueError as exc:
            raise ValueError(f"structured output {spec.kind} is not valid JSON: {exc}") from None

    def add(self, req) -> None:
        self._compiles[req.request_id] = self.compiler.submit(req.sampling_params.structured)

    def poll(self, req) -> bool:
        rid = req.request_id
        if rid in self._matchers:
            return True
        future = self._compiles[rid]
        if not future.done():
            return False
        del self._compiles[rid]
        try:
            compiled = future.result()
        except StructuredOutputError:
            raise
        except Exception as exc:  # noqa: BLE001 - the tokenizer, xgrammar: this request's failure only
            logger.exception("compiling the %s of request %s failed", req.sampling_params.structured.kind, rid)
            raise StructuredOutputError(req.sampling_params.structured.kind, f"{type(exc).__name__}: {exc}") from None
        self._matchers[rid] = self._matcher(req, compiled)
        return True

    def _matcher(self, req, compiled):
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        for token in req.output_token_ids:              # the prefill node's first token (disaggregated decode)
            if not matcher.accept_token(token):
                kind = KIND_NAMES[req.sampling_params.structured.kind]
                raise ValueError(f"the first output token {token} (from the prefill node) does not match the "
                                 f"request's {kind}")
        return matcher

    def bitmask(self, scheduled) -> GrammarBitmask | None:
        """The step's mask: a row for each scheduled item that samples and has a constraint; None if none."""
        reqs = [item.request for item in scheduled if item.samples and item.request.request_id in self._matchers]
        if not reqs:
            return None
        mask = GrammarBitmask.allocate([r.request_id for r in reqs], self.vocab_size)
        for req in reqs:
            row = mask.rows[req.request_id]
            self._matchers[req.request_id].fill_next_token_bitmask(mask.mask, row)
            if req.banned_token_ids:                    # before min_tokens: may the constraint go on?
                req.grammar_ends = not _allows_other_than(mask.mask[row], req.banned_token_ids)
        return mask

    def accept(self, req, token_id: int) -> bool:
        """Advance ``req``'s matcher by its sampled token; True if the constraint is now complete."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            kind = KIND_NAMES[req.sampling_params.structured.kind]
            hint = f" (min_tokens={req.sampling_params.min_tokens} bans the tokens that end it)" \
                if req.num_output_tokens <= req.sampling_params.min_tokens else ""
            raise ValueError(f"sampled token {token_id} does not continue the request's {kind}{hint}")
        return matcher.is_terminated()

    def release(self, request_id: str) -> None:
        self._compiles.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _allows_other_than(row, banned) -> bool:
    """Whether bitmask ``row`` ([W] int32) allows a token outside ``banned``."""
    bits = row.numpy().view(np.uint32).copy()
    for t in banned:
        if 0 <= t < len(bits) * 32:
            bits[t // 32] &= ~np.uint32(1 << (t % 32))
    return bool(bits.any())
