"""pdserve.decode — the decode role's half of the KV hand-off: loading prompt KV from the store.

Who calls it: ``pdserve.engine.kv.kv_connector.StoreConnector``: the scheduler asks how many prompt
tokens the store can supply (``ChunkLoader.lookup``, run on the lookup thread from the request's arrival:
``lookups.py``; the request waits in the queue until it answered), the request waits in ``WAITING_FOR_KV`` while
``ChunkLoader`` scatters the leading chunks into its blocks on the loader thread, and the
scheduler resumes it with whatever arrived (a miss or a bad object means those tokens are
recomputed, never read wrong). With ``--kv-load-layerwise`` the request runs at once and the step's loads are
read layer by layer, the model waiting per layer (``layerwise.py``, ``layer_reader.py``).
"""

from pdserve.decode.loader import ChunkLoader, LoadJob

__all__ = ["ChunkLoader", "LoadJob"]
