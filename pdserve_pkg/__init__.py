"""pdserve: LLM serving with disaggregated prefill and decode and a tiered KV store.

The subpackages are the architecture (see README.md):
``pdserve.engine`` (what every node shares), ``pdserve.prefill``, ``pdserve.decode``,
``pdserve.kvstore``, ``pdserve.proxy``, ``pdserve.kernels`` and ``pdserve.bench``.
"""

__version__ = "0.1.0"
