"""pdserve.engine.parallel — a node as a driver plus tensor x pipeline parallel worker processes.

Used by ``LLMEngine`` instead of ``ModelRunner`` when ``--tensor-parallel-size`` x
``--pipeline-parallel-size`` > 1 (or with ``--debug-sync``). Map, in the order a step meets it:

    executor    driver side: starts the ranks (the rendezvous store), sends steps, collects tokens
    devices     which device and backend a rank uses (CPU + gloo; a GPU each + nccl; a shared GPU + gloo)
    rendezvous  the rendezvous store (a FileStore in a 0700 dir; a TCPStore with --nnodes > 1) and the
                launcher process (fds, lifeline)
    channels    the driver's queues to and from the ranks
    broadcast   THE message queue: where the scheduler output is broadcast to the workers
    shm         anonymous shared memory (memfd) handed down by fd: nothing in /dev/shm to leak
    messages    the typed (msgspec) messages between driver and ranks
    launcher    one process per machine that imports torch once and forks the ranks
    worker      one rank's main loop
    stage       one rank's share of a step: micro-batches, recv / layers (or a graph replay) / send, sampling
    graphs      decode CUDA graphs on nccl ranks (captured per bucket, all-reduce inside); who runs eager and why
    tp          column / row / vocab-parallel wiring and the collectives
    kv          KV publish / load when the cache lives in the ranks
    watchdog    per-rank heartbeat (step, phase) and the report that names a dead or stuck rank
    mirror      heartbeats of ranks on other machines (--nnodes > 1)
    faults      fault injection for tests (PDSERVE_FAULTS: slowed layers, a slow start)
"""
