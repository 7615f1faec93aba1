"""The API process's half of the outputs (``--engine-core-process``): token ids in, text and stop strings out.

Called by ``EngineCoreClient`` under its lock: ``add`` when it sends an AddRequest, ``remove`` on abort,
``process`` for every ``CoreOutput`` (receiver thread). Each request has a ``RequestText``, the in-process
engine's detokenizer and finish rules, so both node kinds answer alike field by field.

A stop string ends a request here; when the core still runs it, ``process`` says so and the client sends
``StopRequests``. Tokens the core produced meanwhile (in flight) are dropped, so the token ids, logprobs
and usage stop at the token that completed the string, as in-process:

    core    t5 ─ t6 ─ t7 ─ t8 ─ final (stopped: blocks freed; KV accounting, transfer params)
    API     t5 ─ t6 "stop" found ─ (t7, t8 dropped) ─ final merged into t6's
            └ without a KV store: t6 is delivered final at once, the core's final output is dropped
            └ with one: t6 waits for the core's final output, whose kv_accounting / kv_transfer_params it
              carries (what the in-process node puts on its final output)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.core import messages as m
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.runner.sampler import generator_draws
from pdserve.engine.text.detokenizer import RequestText


@dataclass
class _Request:
    seq: int
    params: object
    text: RequestText
    num_tokens: int = 0                    # output tokens delivered
    ended: RequestOutput | None = None     # finished here by a stop string, waiting for the core's final output


class OutputProcessor:
    def __init__(self, tokenizer, wait_for_core: bool):
        """``wait_for_core``: a stop-string-ended request's final output waits for the core's (a node with a
        KV store: its accounting and transfer params)."""
        self.tokenizer, self.wait_for_core = tokenizer, wait_for_core
        self._reqs: dict[str, _Request] = {}

    def add(self, request_id: str, seq: int, prompt_token_ids: list[int], params) -> None:
        self._reqs[request_id] = _Request(seq, params, RequestText(self.tokenizer, prompt_token_ids, params))

    def first_token_stop(self, prompt_token_ids: list[int], params, transfer) -> str | None:
        """The stop string the prefill node's first token (``transfer.first_token_id``) completes, if any: the
        core ends such a request at add, never scheduled, as the in-process engine does (no KV load)."""
        if transfer is None or not transfer.do_remote_prefill or transfer.first_token_id is None:
            return None
        return RequestText(self.tokenizer, prompt_token_ids, params).add_token(transfer.first_token_id, None)[1]

    def remove(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def is_current(self, request_id: str, seq: int) -> bool:
        r = self._reqs.get(request_id)
        return r is not None and r.seq == seq

    def process(self, wire: m.CoreOutput) -> tuple[RequestOutput | None, str | None]:
        """-> (what to deliver, None for nothing; the stop string to send the core, None for nothing).
        Outputs of an add that is no longer current (aborted, replaced) are dropped."""
        r = self._reqs.get(wire.request_id)
        if r is None or r.seq != wire.seq:
            return None, None
        if r.ended is not None:                        # the rest of what the core sent: only its final counts
            if not wire.finished:
                return None, None
            del self._reqs[wire.request_id]
            return self._merge_final(r, wire), None
        out = self._detokenize(r, wire)
        ended_here = out.finished and not wire.finished
        if ended_here and self.wait_for_core:
            r.ended = out
        elif out.finished:
            del self._reqs[wire.request_id]
        return (None if r.ended is out else out), (out.stop_reason if ended_here else None)

    def _detokenize(self, r: _Request, wire: m.CoreOutput) -> RequestOutput:
        out = m.output_from_wire(wire)
        ids, texts, stop = wire.new_token_ids, [], None
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            text, stop = r.text.add_token(token_id, wire.finish_reason if wire.finished and last else None)
            texts.append(text)
            if stop is not None:
                break
        kept = len(texts)
        r.num_tokens += kept
        out.new_text = "".join(texts)
        if stop is None:
            return out
        logprobs = None if out.logprobs is None else out.logprobs[:kept]
        return replace(out, new_token_ids=ids[:kept], logprobs=logprobs, finished=True, finish_reason="stop",
                       stop_reason=stop, error=None)

    def _merge_final(self, r: _Request, wire: m.CoreOutput) -> RequestOutput:
        """The stop-string-ended output with the core's final figures. The seeded sampling's draws count
        only the tokens delivered (the core may have sampled more before it stopped)."""
        transfer = None
        if wire.kv_transfer_params is not None:
            transfer = wire.kv_transfer_params.to_json_obj()
            transfer["sampler_draws"] = generator_draws(r.params, r.num_tokens)
        return replace(r.ended, kv_transfer_params=transfer, kv_accounting=wire.kv_accounting, times=wire.times)
