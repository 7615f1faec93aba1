"""pdserve.proxy — placeholder package, filled by its own issue."""
