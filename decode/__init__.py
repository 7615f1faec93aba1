"""pdserve.decode — placeholder package, filled by its own issue."""
