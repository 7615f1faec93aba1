"""The engine core in a process of its own (``pdserve node``'s default; ``--no-engine-core-process`` turns it off), vLLM V1's split.

    API process (pdserve node)                         engine-core process (python -m ...core.proc)
    --------------------------                         --------------------------------------------
    HTTP, tokenizer, chat templates, streaming         LLMEngine: schedule -> execute -> update,
    AsyncEngine ── EngineCoreClient ──AddRequest──>    token ids out (OutputAssembler without text),
                                    ──AbortRequests──> KV connector, tp x pp ranks under it
                                    ──StopRequests──>  (a stop string the API process found)
                   (receiver thread) <──CoreOutputs──  one batch per step: token deltas, rejects, stats
                   OutputProcessor: detokenizer + stop strings per request
                   (watcher thread)  <──Fatal / exit── a failed step, a dead rank, a killed process

Who calls what: ``AsyncEngine(config)`` with ``config.engine_core_process`` builds an ``EngineCoreClient``
(``client.py``) in place of an ``LLMEngine``; the client starts the core (``proc.py``), answers
``check_prompt`` / ``check_transfer`` locally from what the core reported when ready, sends requests and
aborts, and hands each step's outputs to ``AsyncEngine``'s per-request queues. Every message is a
``msgspec.Struct`` in ``messages.py``. Detokenization and stop strings are the API process's
(``output_processor.py``, vLLM V1's split) with the in-process engine's code (``detokenizer.RequestText``):
the core decides eos, stop token ids and length; a stop string found in the API process ends the request
there and a ``StopRequests`` ends it in the core (blocks freed).

Lifetime: the core runs in its own session and ignores SIGINT / SIGTERM (the API process drains, then
sends ``Shutdown``); it dies with the API process (``PR_SET_PDEATHSIG`` and EOF on its stdin, the
lifeline). A core that exits is seen by the client at once (it waits on the pid): every stream fails,
``/health`` answers 503 and the node exits 1.
"""
