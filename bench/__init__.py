"""pdserve.bench — serving benchmarks whose numbers sit beside ``vllm bench serve``'s.

Who calls it: ``pdserve bench serve`` and ``pdserve bench sweep`` (``cli.register``, wired into
``pdserve.engine.cli``). A run: ``serve.run_bench(BenchConfig)`` builds a fixed-seed dataset (``datasets``,
``datasets_rounds``; what they share: ``dataset_base``), sends it on vLLM's arrival schedule (``runner`` ->
``client``), computes the metrics exactly as vLLM defines them (``metrics``), prints vLLM's table and returns
vLLM's result keys plus a ``"pdserve"`` block of KV accounting scraped from the nodes (``report``, ``scrape``).
A sweep starts a local cluster per setting (``sweep``) and writes one table (``sweep_table``) and plots
(``plots``). ``pdserve bench kvstore`` measures the KV store's data plane against raw memcpy, pyzmq and
redis-py baselines from the same run (``kvstore_bench`` measures, ``kvstore_table`` prints). See bench/README.md for the command lines, including vLLM, guidellm and aiperf against the proxy. Developer
benchmarks (micro-benchmarks, stress and lifecycle runs, the vLLM peer comparison) are scripts in devbench/, not
part of this package (tests/test_imports.py checks that every module here is reached from ``cli``).
"""
