"""pdserve.engine.sched."""
