"""pdserve.engine.text."""
