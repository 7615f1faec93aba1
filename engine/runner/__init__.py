"""pdserve.engine.runner."""
