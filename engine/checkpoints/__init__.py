"""pdserve.engine.checkpoints."""
