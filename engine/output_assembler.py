"""Turn scheduler/sampler results into per-request ``RequestOutput`` deltas.

Called by ``LLMEngine`` on the engine thread: ``track`` when a request arrives, ``collect`` after
every step, ``forget`` on abort. It owns each request's detokenizer (text deltas, stop strings)
and the final-output rules:

    finished request ─┬─ no store, or a decode node ───────────────> final output now
                      └─ publishing its prompt KV (prefill / both) ─> held until the store
                                                                      acknowledged every chunk
The final output carries the KV accounting (logged once per request at INFO) and, for a request
that asked for remote decode, the ``kv_transfer_params`` the decode node needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request, RequestStatus

logger = logging.getLogger("pdserve.kv")


@dataclass
class _Live:
    req: Request
    detok: IncrementalDetokenizer
    transfer: object | None          # KVTransferParams the request came with


class OutputAssembler:
    def __init__(self, tokenizer, scheduler, runner, connector, role: str):
        self.tokenizer, self.scheduler, self.runner = tokenizer, scheduler, runner
        self.connector, self.role = connector, role
        self._live: dict[str, _Live] = {}
        self._ready: list[RequestOutput] = []          # produced between steps
        self._held: dict[str, RequestOutput] = {}      # finished, waiting for the publish ack
        self.totals = {"total_tokens": 0, "local_hit_tokens": 0, "store_hit_tokens": 0, "loaded_tokens": 0,
                       "recomputed_tokens": 0}

    def track(self, req: Request, transfer) -> None:
        p = req.sampling_params
        self._live[req.request_id] = _Live(req, IncrementalDetokenizer(self.tokenizer, p.stop,
                                                                       p.include_stop_str_in_output), transfer)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live or request_id in self._held

    def has_live(self) -> bool:
        return bool(self._live or self._held or self._ready)

    def forget(self, request_id: str) -> bool:
        """Abort: drop everything about the request; True if it was still running."""
        self._held.pop(request_id, None)
        live = self._live.pop(request_id, None)
        self.runner.release(request_id)
        if self.connector is not None:
            self.connector.close(request_id)
            self.connector.release(request_id)
        return live is not None

    def first_token_from_prefill(self, req: Request, stop_status) -> bool:
        """A decode request starts with the prefill node's token: emit it now. True if that ended it."""
        if stop_status is not None:
            req.status = stop_status
        out = self._emit_token(req.request_id, req.output_token_ids[0], None)
        if out is not None:
            self._ready.append(out)
        return stop_status is not None

    def collect(self, sampled: dict, rejected=()) -> list[RequestOutput]:
        """Deltas for the step's sampled tokens; final outputs for ``rejected`` (finished without a token)."""
        outs, self._ready = self._ready, []
        for rid, res in sampled.items():
            if rid in self._live:
                out = self._emit_token(rid, res.token_id, res)
                if out is not None:
                    outs.append(out)
        outs += self._finished_without_token(rejected)
        outs += self._published()
        return outs

    def _emit_token(self, request_id: str, token_id: int, result) -> RequestOutput | None:
        live = self._live[request_id]
        req, detok = live.req, live.detok
        text = detok.add_tokens([token_id])
        if detok.stopped_by is not None and not req.status.is_finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = detok.stopped_by
        if req.status.is_finished:
            text += detok.flush()
        logprobs = [result] if result is not None and req.sampling_params.logprobs is not None else None
        out = self._output(req, [token_id], text, logprobs, live.transfer)
        return self._finish(live, out) if req.status.is_finished else out

    def _finished_without_token(self, rejected) -> list[RequestOutput]:
        done = [self._live[r.request_id] for r in rejected if r.request_id in self._live]
        outs = [self._finish(lv, self._output(lv.req, [], "", None, lv.transfer)) for lv in done]
        return [o for o in outs if o is not None]

    def _finish(self, live: _Live, out: RequestOutput) -> RequestOutput | None:
        req = live.req
        del self._live[req.request_id]
        self.runner.release(req.request_id)
        if self.connector is None:
            return out
        acc = self.connector.accounting(req)
        out.kv_accounting = self._account(req, acc)
        if live.transfer is not None and live.transfer.do_remote_decode:
            out.kv_transfer_params = self.connector.transfer_params(req).to_json_obj()
        if self.role == "decode" or req.status == RequestStatus.FINISHED_ABORTED:
            self.connector.release(req.request_id)
            return out
        self.connector.close(req.request_id)
        self._held[req.request_id] = out
        return None

    def _published(self) -> list[RequestOutput]:
        if self.connector is None or not self._held:
            return []
        outs = []
        for rid in self.connector.finished_publishes():
            out = self._held.pop(rid, None)
            self.connector.release(rid)
            if out is not None:
                outs.append(out)
        return outs

    def _account(self, req: Request, acc) -> dict:
        logger.info("req=%s %s", req.request_id, acc.log_line())
        figures = {name: getattr(acc, name) for name in ("total_tokens", "local_hit_tokens", "store_hit_tokens",
                                                          "need_to_load", "loaded_tokens", "recomputed_tokens")}
        for name in self.totals:
            self.totals[name] += figures[name]
        return figures

    def _output(self, req: Request, tokens: list[int], text: str, logprobs, transfer) -> RequestOutput:
        error = req.stop_reason if req.status == RequestStatus.FINISHED_ABORTED else None
        cached = _cached_tokens(req, transfer)
        return RequestOutput(request_id=req.request_id, new_token_ids=tokens, new_text=text,
                             finished=req.status.is_finished, finish_reason=req.finish_reason,
                             num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=cached,
                             logprobs=logprobs, error=error if isinstance(error, str) else None)


def _cached_tokens(req: Request, transfer) -> int:
    """Prompt tokens reused instead of computed where the prompt was prefilled.

    On a decode node that is the prefill node's figure (its prefix cache + its store load);
    loading what the prefill node just published is a transfer, not a cache hit.
    """
    if transfer is not None and transfer.do_remote_prefill:
        acc = transfer.accounting or {}
        return acc.get("local_hit_tokens", 0) + acc.get("loaded_tokens", 0)
    return req.num_cached_tokens + req.num_loaded_tokens
