"""The engine core: the step loop and the three ways a caller drives it.

    llm_engine.py        LLMEngine: add_request / step (schedule -> run the model -> publish KV -> outputs) / abort
    output_assembler.py  the engine's per-request deltas and final outputs (text, KV accounting, transfer params,
                         prompt logprobs joined over a prompt's chunks)
    async_engine.py      AsyncEngine, behind the HTTP node: one engine thread steps LLMEngine, asyncio callers stream
    proc.py, client.py   the same core in a process of its own: EngineCoreClient in the API process, proc.py there
    channel.py           the private link between them (two zmq sockets in a 0700 directory, a token in Hello)
    messages.py          every message on that link (msgspec structs)
    output_processor.py  the API process's half of the outputs: detokenization and stop strings

Called by ``LLM`` (offline, ``engine/llm.py``: LLMEngine in the calling thread), ``pdserve node``
(``engine/node.py``: AsyncEngine, which holds an LLMEngine or, by default, an EngineCoreClient) and the HTTP server
(``server/``, through AsyncEngine). Under LLMEngine: scheduling (``sched/``), the model runner (``runner/``) or the
tp x pp ranks (``parallel/``), the KV connection (``kv/``).

The engine core in a process of its own (``pdserve node``'s default; ``--no-engine-core-process`` turns it off), vLLM V1's split.

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

The link is private (``channel.py``). The API process binds two zmq ROUTER sockets ("down": requests to
the core, "up": its outputs) in a directory it makes for the node, mode 0700 (under $XDG_RUNTIME_DIR when
that is ours, else the temp dir), before it starts the core; so the kernel lets only the node's user and
root connect, list or even name-resolve them; nothing is in the abstract namespace any more, where anyone
could connect. A fresh ``secrets`` token reaches the core on stdin inside ``StartCore`` (never on a
command line or in a log); the core's first frame on each of its two DEALER connections is ``Hello``
with it. The API process reads messages only from the two connections that proved it and sends only to
the core's: a second connection (of the node's own user, the only one the kernel admits) is ignored even if
it came first: it can neither read outputs nor inject, nor take the core's place (a ROUTER serves every
connection apart, it has no single peer slot to steal). Once both Hellos came (the core's imports; before
the model loads) the socket files and the directory are removed: no one can connect again; a failed start
or a dead core removes them too (``close``). A frame that does not decode, on either side, is dropped and
counted (logged at most every 10 s): never fatal.

Lifetime: the core runs in its own session and ignores SIGINT / SIGTERM (the API process drains, then
sends ``Shutdown``); it dies with the API process (``PR_SET_PDEATHSIG`` and EOF on its stdin, the
lifeline). A core that exits is seen by the client at once (it waits on the pid): every stream fails,
``/health`` answers 503 and the node exits 1.
"""
