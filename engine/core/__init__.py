"""The engine core in a process of its own (``pdserve node --engine-core-process``), vLLM V1's split.

    API process (pdserve node)                         engine-core process (python -m ...core.proc)
    --------------------------                         --------------------------------------------
    HTTP, tokenizer, chat templates, streaming         LLMEngine: schedule -> execute -> update,
    AsyncEngine ── EngineCoreClient ──AddRequest──>    detokenizer + stop strings (OutputAssembler),
                                    ──AbortRequests──> KV connector, tp x pp ranks under it
                   (receiver thread) <──CoreOutputs──  one batch per step: deltas, rejects, stats
                   (watcher thread)  <──Fatal / exit── a failed step, a dead rank, a killed process

Who calls what: ``AsyncEngine(config)`` with ``config.engine_core_process`` builds an ``EngineCoreClient``
(``client.py``) in place of an ``LLMEngine``; the client starts the core (``proc.py``), answers
``check_prompt`` / ``check_transfer`` locally from what the core reported when ready, sends requests and
aborts, and hands each step's outputs to ``AsyncEngine``'s per-request queues. Every message is a
``msgspec.Struct`` in ``messages.py``. Detokenization stays in the core, beside the stop-string checks
that end requests there (exactly what the in-process engine does).

Lifetime: the core runs in its own session and ignores SIGINT / SIGTERM (the API process drains, then
sends ``Shutdown``); it dies with the API process (``PR_SET_PDEATHSIG`` and EOF on its stdin, the
lifeline). A core that exits is seen by the client at once (it waits on the pid): every stream fails,
``/health`` answers 503 and the node exits 1.
"""
