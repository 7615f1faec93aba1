"""Run one request on an in-process ``LLMEngine`` to completion (shared by the engine-level KV tests)."""

from __future__ import annotations


def run_request(engine, rid, prompt, params, transfer=None, cache_salt=None):
    """-> (every token id the request produced, its final ``RequestOutput``)."""
    if cache_salt is None:
        engine.add_request(rid, prompt, params, transfer)
    else:
        engine.add_request(rid, prompt, params, transfer, cache_salt=cache_salt)
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            final = out if out.finished else final
    return tokens, final
