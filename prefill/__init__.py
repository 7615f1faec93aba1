"""pdserve.prefill — the prefill role's half of the KV hand-off: publishing prompt KV to the store.

Who calls it: ``pdserve.engine.kv.kv_connector.StoreConnector`` (engine thread) after every model step,
for nodes started with ``--role prefill`` (and ``--role both`` with a store, which publishes too).
``ChunkPublisher`` copies each prompt chunk out of the paged cache into a slot of its fixed publish ring
(``--kv-publish-buffer-bytes``; a full ring makes the step wait) as soon as the step that
completed it ran, and puts its per-layer objects to the store on its own thread; the prefill
answer (with ``kv_transfer_params``) waits until the store acknowledged every chunk. With
``--kv-publish-layerwise`` (``layerwise.py``) the model's per-layer hook hands each layer of the step's
completed chunks over as soon as it ran, and the puts overlap the layers still computing.
"""

from pdserve.prefill.publisher import ChunkPublisher

__all__ = ["ChunkPublisher"]
