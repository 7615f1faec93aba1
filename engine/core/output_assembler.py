"""Turn scheduler/sampler results into per-request ``RequestOutput`` deltas.

Called by ``LLMEngine`` on the engine thread: ``track`` when a request arrives, ``collect`` after
every step, ``forget`` on abort, ``stop`` when the API process found a stop string. It owns each
request's text (``detokenizer.RequestText``: text deltas, stop strings) and the final-output rules:

    finished request ─┬─ no store, or a decode node ───────────────> final output now
                      └─ publishing its prompt KV (prefill / both) ─> held until the store
                                                                      acknowledged every chunk
The final output carries the KV accounting (logged once per request at INFO) and, for a request
that asked for remote decode, the ``kv_transfer_params`` the decode node needs: the KV's, plus the
first token's logprobs and the seeded sampling's draw count, so that the decode node answers exactly
what a colocated node would.

Prompt logprobs (a request that asked for them): the runner's chunks are joined in ``collect`` and the whole
list goes out with the first token (``RequestOutput.prompt_logprobs``) -- or fails the request if a prompt token
is missing -- and, on a prefill node, into ``kv_transfer_params``; a decode node has them from the prefill node.

Finish rules: ``RequestText``'s (vLLM's). Without a tokenizer (the engine-core process of
``--engine-core-process``) outputs carry token ids only: the API process detokenizes, finds stop
strings and calls ``stop`` (a ``StopRequests`` message) for a request they end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.engine.outputs import RequestOutput, RequestTimes, finite_logprob
from pdserve.engine.runner.sampler import SampleResult, generator_draws
from pdserve.engine.sched.request import Request, RequestStatus
from pdserve.engine.text.detokenizer import RequestText

logger = logging.getLogger("pdserve.kv")


@dataclass
class _Live:
    req: Request
    text: RequestText | None         # None: token ids only (the API process detokenizes)
    transfer: object | None          # KVTransferParams the request came with
    first: SampleResult | None = None   # the first output token's sample (its logprobs go to the decode node)
    prompt: list | None = None          # PromptLogprob of prompt tokens 1.. so far (None: not asked for)
    prompt_sent: bool = False           # they went out with the first token
    last: float = 0.0                   # time.monotonic() it finished here (RequestTimes.last_token)


class OutputAssembler:
    def __init__(self, tokenizer, scheduler, runner, connector, role: str):
        """``tokenizer`` None: no text, no stop strings (``--engine-core-process``'s core)."""
        self.tokenizer, self.scheduler, self.runner = tokenizer, scheduler, runner
        self.connector, self.role = connector, role
        self._live: dict[str, _Live] = {}
        self._ready: list[RequestOutput] = []          # produced between steps
        self._held: dict[str, tuple[RequestOutput, _Live]] = {}   # finished, waiting for the publish ack
        self.totals = {"total_tokens": 0, "local_hit_tokens": 0, "store_hit_tokens": 0, "need_to_load_tokens": 0,
                       "loaded_tokens": 0, "recomputed_tokens": 0}    # exported as pdserve_kv_<name>_total

    def track(self, req: Request, transfer, prompt_logprobs: list | None = None) -> None:
        """``prompt_logprobs``: known already (the prefill node's, on a decode node)."""
        text = None if self.tokenizer is None else \
            RequestText(self.tokenizer, req.prompt_token_ids, req.sampling_params)
        prompt = prompt_logprobs if prompt_logprobs is not None else [] if req.computes_prompt_logprobs else None
        self._live[req.request_id] = _Live(req, text, transfer, prompt=prompt)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live or request_id in self._held

    def has_live(self) -> bool:
        return bool(self._live or self._held or self._ready)

    def forget(self, request_id: str) -> bool:
        """Abort: drop everything about the request; True if it was still running."""
        self._held.pop(request_id, None)
        self._ready = [o for o in self._ready if o.request_id != request_id]   # not sent: never for a new add
        live = self._live.pop(request_id, None)
        self.runner.release(request_id)
        if self.connector is not None:
            self.connector.forget(request_id)
        return live is not None

    def stop(self, request_id: str, stop_string: str) -> None:
        """The API process found ``stop_string`` in a request this core still runs: finish it as stopped
        (blocks freed), its final output (no tokens) carrying what a stop found here would: the KV
        accounting, and after the publish the ``kv_transfer_params``. A request that already finished
        here is left alone: its final output is on its way."""
        live = self._live.get(request_id)
        if live is None:
            return
        self._stop_on_string(live.req, stop_string)
        out = self._finish(live, self._output(live.req, [], "", None, live.transfer))
        if out is not None:
            self._ready.append(out)

    def first_token_from_prefill(self, req: Request, stop_status) -> bool:
        """A decode request starts with the prefill node's token: emit it now (with the prefill node's
        logprobs for it). True if that ended it (eos, stop id, length or a stop string): not to be scheduled."""
        if stop_status is not None:
            req.status = stop_status
        transfer = self._live[req.request_id].transfer
        first = req.output_token_ids[0]
        sample = None
        if transfer.first_token_logprob is not None:
            sample = SampleResult(first, transfer.first_token_logprob,
                                  _tops(transfer.first_token_top_logprobs, req.sampling_params.logprobs))
        out = self._emit_token(req.request_id, first, sample, sampled_here=False)
        if out is not None:
            self._ready.append(out)
        return req.status.is_finished

    def collect(self, sampled: dict, rejected=(), prompt_logprobs: dict | None = None) -> list[RequestOutput]:
        """Deltas for the step's sampled tokens; final outputs for ``rejected`` (finished without a token).
        ``prompt_logprobs``: the step's chunks, {request_id: (first prompt index, [PromptLogprob])}."""
        outs, self._ready = self._ready, []
        for rid, (first, entries) in (prompt_logprobs or {}).items():
            live = self._live.get(rid)
            skip = -1 if live is None or live.prompt is None else len(live.prompt) + 1 - first
            if skip >= 0:                                                 # a recompute (preemption) repeats some
                live.prompt += entries[skip:]
        for rid, res in sampled.items():
            if rid in self._live:
                out = self._emit_safely(rid, res)
                if out is not None:
                    outs.append(out)
        outs += self._finished_without_token(rejected)
        outs += self._published()
        return outs

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a live request with an error: its blocks are freed, its final output carries ``message``."""
        live = self._live.get(request_id)
        if live is None:
            return None
        req = live.req
        logger.warning("request %s failed: %s", request_id, message)
        req.stop_reason = message
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        req.status = RequestStatus.FINISHED_ABORTED
        return self._finish(live, self._output(req, [], "", None, live.transfer))

    def _emit_safely(self, request_id: str, result) -> RequestOutput | None:
        """``_emit_token``; an exception there (detokenizer, stop strings) fails this request only."""
        try:
            return self._emit_token(request_id, result.token_id, result)
        except Exception as exc:  # noqa: BLE001 - one request's failure is that request's
            return self.fail(request_id, f"output processing failed: {type(exc).__name__}: {exc}")

    def _emit_token(self, request_id: str, token_id: int, result, sampled_here: bool = True) -> RequestOutput | None:
        live = self._live[request_id]
        req = live.req
        first_here = sampled_here and not req.first_token_time
        if first_here:
            req.first_token_time = time.monotonic()
        if live.first is None:
            live.first = result
        prompt = self._prompt_once(live)
        text, stop = ("", None) if live.text is None else live.text.add_token(token_id, req.finish_reason)
        if stop is not None:
            self._stop_on_string(req, stop)
        logprobs = [result] if result is not None and req.sampling_params.logprobs is not None else None
        out = self._output(req, [token_id], text, logprobs, live.transfer)
        out.prompt_logprobs = prompt
        if req.status.is_finished:
            return self._finish(live, out)
        if first_here:
            out.times = self._times(live)
        return out

    def _prompt_once(self, live: _Live) -> list | None:
        """The prompt logprobs for the request's first token, all of them (else it fails), once."""
        if live.prompt is None or live.prompt_sent:
            return None
        if len(live.prompt) != live.req.num_prompt_tokens - 1:
            raise RuntimeError(f"prompt logprobs cover {len(live.prompt)} of the prompt's "
                               f"{live.req.num_prompt_tokens - 1} tokens after the first")
        live.prompt_sent = True
        return live.prompt

    def _stop_on_string(self, req: Request, stop_string: str) -> None:
        """A stop string ends the request with "stop", even one that reached max_tokens on this token."""
        if not req.status.is_finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        req.status = RequestStatus.FINISHED_STOPPED
        req.stop_reason = stop_string

    def _finished_without_token(self, rejected) -> list[RequestOutput]:
        done = [self._live[r.request_id] for r in rejected if r.request_id in self._live]
        outs = [self._finish(lv, self._output(lv.req, [], "", None, lv.transfer)) for lv in done]
        return [o for o in outs if o is not None]

    def _finish(self, live: _Live, out: RequestOutput) -> RequestOutput | None:
        req = live.req
        live.last = time.monotonic()
        del self._live[req.request_id]
        self.runner.release(req.request_id)
        if self.connector is None:
            out.times = self._times(live)
            return out
        acc = self.connector.accounting(req)
        out.kv_accounting = self._account(req, acc)
        if self.role == "decode" or req.status == RequestStatus.FINISHED_ABORTED:
            self._attach_transfer(out, live)
            out.times = self._times(live)
            self.connector.forget(req.request_id)
            return out
        self.connector.close(req.request_id)
        self._held[req.request_id] = (out, live)
        return None

    def _attach_transfer(self, out: RequestOutput, live: _Live) -> None:
        """``kv_transfer_params`` for a request that asked for remote decode (after its publish settled)."""
        if live.transfer is not None and live.transfer.do_remote_decode:
            params = self.connector.transfer_params(live.req)
            if live.first is not None:
                params.first_token_logprob = finite_logprob(live.first.logprob)
                params.first_token_top_logprobs = None if live.first.top_logprobs is None else \
                    [(t, finite_logprob(lp)) for t, lp in live.first.top_logprobs]
            params.sampler_draws = generator_draws(live.req.sampling_params, live.req.num_output_tokens)
            params.prompt_logprobs = live.prompt if live.prompt_sent else None
            out.kv_transfer_params = params.to_json_obj()

    def _published(self) -> list[RequestOutput]:
        if self.connector is None or not self._held:
            return []
        outs = []
        for rid in self.connector.finished_publishes():
            held = self._held.pop(rid, None)
            if held is not None:
                self._attach_transfer(*held)
                held[0].times = self._times(held[1])
                outs.append(held[0])
            self.connector.release(rid)
        return outs

    def _times(self, live: _Live) -> RequestTimes:
        """The request's ``RequestTimes`` so far (with the KV connector's load / publish figures)."""
        req = live.req
        kv = self.connector.timing(req.request_id) if self.connector is not None else ()
        return RequestTimes(req.arrival_time, req.scheduled_time, req.first_token_time, live.last,
                            req.num_preemptions, *kv)

    def _account(self, req: Request, acc) -> dict:
        logger.info("req=%s %s", req.request_id, acc.log_line())
        figures = {name: getattr(acc, name) for name in ("total_tokens", "local_hit_tokens", "store_hit_tokens",
                                                          "need_to_load", "loaded_tokens", "recomputed_tokens")}
        for name in self.totals:
            self.totals[name] += figures["need_to_load" if name == "need_to_load_tokens" else name]
        return figures

    def _output(self, req: Request, tokens: list[int], text: str, logprobs, transfer) -> RequestOutput:
        error = req.stop_reason if req.status == RequestStatus.FINISHED_ABORTED else None
        stop = req.stop_reason if req.status == RequestStatus.FINISHED_STOPPED else None
        cached = _cached_tokens(req, transfer)
        return RequestOutput(request_id=req.request_id, new_token_ids=tokens, new_text=text,
                             finished=req.status.is_finished, finish_reason=req.finish_reason,
                             num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=cached,
                             logprobs=logprobs, error=error if isinstance(error, str) else None,
                             stop_reason=stop, step_time=time.monotonic())


def _tops(tops, k: int | None) -> list[tuple[int, float]] | None:
    """The prefill node's top logprobs of the first token, as the sampler returns them for ``logprobs=k``."""
    if k is None:
        return None
    return [(int(t), float(lp)) for t, lp in (tops or [])][:k]


def _cached_tokens(req: Request, transfer) -> int:
    """Prompt tokens reused instead of computed where the prompt was prefilled.

    On a decode node that is the prefill node's figure (its prefix cache + its store load);
    loading what the prefill node just published is a transfer, not a cache hit.
    """
    if transfer is not None and transfer.do_remote_prefill:
        acc = transfer.accounting or {}
        return acc.get("local_hit_tokens", 0) + acc.get("loaded_tokens", 0)
    return req.num_cached_tokens + req.num_loaded_tokens
