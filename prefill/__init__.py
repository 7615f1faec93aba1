"""pdserve.prefill — placeholder package, filled by its own issue."""
