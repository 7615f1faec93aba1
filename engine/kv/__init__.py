"""The KV connection: how a node's paged KV cache meets the KV store, and what prefill hands decode.

Called by ``LLMEngine`` (the store and the connector, once at start; publishes after each step), the ``Scheduler``
(lookups and loads at a prompt's first admission) and the engine-core client (``check_transfer`` on arrival):

    kv_connector.py   StoreConnector: look up and load a prompt's chunks before prefill, publish them after
                      (the chunk publisher is ``pdserve.prefill``, the loader ``pdserve.decode``)
    kv_transfer.py    kv_transfer_params: what a prefill node returns and a decode node checks before loading
    kv_layout.py      KVLayout: the cache's shape per layer (MHA/GQA: k and v; MLA: one latent), read by the runner, the
                      attention and the store
    store_factory.py  the store a node talks to, from its KVTransferConfig (embedded tiers or a daemon client)
    kv_events.py      KV events (blocks cached / evicted) signed and published over ZMQ for the proxy's routing
    kv_replay.py      the replay socket: a subscriber that joins late or lost events reads the whole block set

The store itself (tiers, daemon, seals) is ``pdserve.kvstore``.
"""
