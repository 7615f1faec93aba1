"""Scheduling: which tokens of which requests run in the next step, and which KV blocks hold them. Pure Python.

Called by ``LLMEngine`` (``engine/core/llm_engine.py``) once per step, on the engine thread::

    out = scheduler.schedule()                        # scheduler.py: decode first, then chunked prefill
    sampled = runner.execute(out)                     # (the model runner; runner/)
    finished = scheduler.update_from_output(out, sampled)

    scheduler.py      continuous batching under --max-num-batched-tokens, chunked prefill, preemption by recompute
    block_manager.py  the paged KV cache's blocks: free list, ref counts, prefix cache (LRU), check_integrity()
    request.py        one request as scheduling sees it: status, token counts, block ids, stop checks

A request with a structured-output constraint waits in WAITING_FOR_GRAMMAR until ``structured/`` compiled it (the
scheduler asks its ``grammars`` manager each step), and each sampled token advances its matcher.
    hashing.py        chained xxh64 hashes of full blocks, the prefix cache's keys (salted by cache_salt)

Nothing here touches a tensor: tests drive it with tiny block sizes and assert exact block ids.
"""
