"""Host time per engine step per running request: the cost the model does not explain.

    python devbench/host_step.py [--batch 32 256] [--context 600] [--steps 30]

A 1-layer, hidden-32 Llama makes the model's own work negligible, so an engine step's wall time is
host work: scheduling, building the step's inputs, sampling, updating requests and assembling
outputs. ``batch`` requests are prefilled to ``context`` tokens, then ``steps`` decode steps are
timed (the best of three runs). Prints ms per step and microseconds per running request, and the
share of ``ModelRunner.execute`` (input building + forward + sampling) in it; ``--output`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def measure(model_dir: str, batch: int, context: int, steps: int) -> dict:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=context + 4 * steps + 16,
              enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)
    engine, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"h{i}", torch.randint(10, 200, (context,), generator=g).tolist(),
                           SamplingParams(max_tokens=4 * steps + 8, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    execute, spent = runner.execute, [0.0]

    def timed(out):
        t = time.perf_counter()
        try:
            return execute(out)
        finally:
            spent[0] += time.perf_counter() - t

    runner.execute = timed
    best = None
    for _ in range(3):
        spent[0] = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
        if best is None or total < best[0]:
            best = (total, spent[0])
    llm.shutdown()
    step_ms = best[0] / steps * 1e3
    return {"batch": batch, "context": context, "step_ms": step_ms, "us_per_request": step_ms * 1e3 / batch,
            "execute_share": best[1] / best[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_tiny_model(d, arch="llama", seed=0, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, max_position_embeddings=4096)
        for b in args.batch:
            r = measure(d, b, args.context, args.steps)
            rows.append(r)
            print(f"batch {b:>4}: {r['step_ms']:7.2f} ms/step  {r['us_per_request']:7.1f} us per running request  "
                  f"(execute {r['execute_share']:.0%})", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
