"""pdserve.engine.kv."""
