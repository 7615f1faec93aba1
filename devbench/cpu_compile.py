"""Compiled vs eager model steps on CPU: what ``torch.compile`` of the layers' non-attention parts buys.

    python devbench/cpu_compile.py [--model DIR|smollm2-135m-instruct] [--batch 32 256] [--context 550]
                                [--samples 15] [--output out.json]

Fixed seed, one torch thread, fp32. Without ``--model``: a 4-layer hidden-256 tiny Llama (vocab 512).
One engine is built with compile on (its start-up time is printed: run twice to see a warm inductor
cache); each shape is then timed with the compiled pieces and with eager ones, alternating step by
step, the median of each (so a shared machine's noise hits both alike):

    layers    the non-attention parts alone (every layer, attention stood in for by q) at 32 / 256 /
              2048 rows: what compile changes, without the attention that dominates decode steps
    prefill   4 fresh sequences of 512 tokens in one 2048-token step
    decode    ``batch`` sequences prefilled to ``context`` tokens, then one-token steps

A step's figure is ``ModelRunner.execute`` (inputs, forward, sampling); ratio = compiled / eager.
Each shape's first step runs untimed (first-call costs, in either mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
import time

import torch


class Timer:
    """Wraps ``runner.execute``; ``take()`` returns the seconds spent since the last take."""

    def __init__(self, runner):
        self.spent, self.calls, execute = 0.0, 0, runner.execute

        def timed(out):
            t = time.perf_counter()
            try:
                return execute(out)
            finally:
                self.spent += time.perf_counter() - t
                self.calls += 1

        runner.execute = timed

    def take(self) -> tuple[float, int]:
        out, self.spent, self.calls = (self.spent, self.calls), 0.0, 0
        return out


def _prompt(g, vocab: int, n: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def time_prefill(llm, timer, g, vocab: int) -> float:
    """ms of one step prefilling 4 fresh 512-token sequences (max_tokens 1: nothing else runs)."""
    from pdserve.engine import SamplingParams

    llm.generate([_prompt(g, vocab, 512) for _ in range(4)], SamplingParams(max_tokens=1, ignore_eos=True))
    spent, calls = timer.take()
    assert calls == 1, f"the prefill took {calls} steps"
    return spent * 1e3


def start_decodes(llm, g, vocab: int, batch: int, context: int) -> list[str]:
    """``batch`` sequences prefilled to ``context`` tokens, decoding until aborted (or max_model_len)."""
    from pdserve.engine import SamplingParams

    engine, ids = llm.engine, [f"d{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=engine.runtime.max_model_len - context, temperature=0.0, ignore_eos=True)
    for rid in ids:                      # the first ones decode while the others prefill: aborted when timed
        engine.add_request(rid, _prompt(g, vocab, context), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    return ids


def time_decode(llm, timer) -> float:
    """ms of one decode step of every running sequence."""
    llm.engine.step()
    spent, calls = timer.take()
    return spent / calls * 1e3


def ab(runner, compiled, measure, samples: int) -> dict:
    """Median ms of ``measure()`` with the compiled pieces and without, alternating step by step."""
    ms = {"eager": [], "compiled": []}
    for _ in range(samples):
        for mode in ("compiled", "eager"):
            runner.compiled = compiled if mode == "compiled" else None
            ms[mode].append(measure())
    runner.compiled = compiled
    e, c = statistics.median(ms["eager"]), statistics.median(ms["compiled"])
    return {"eager_ms": e, "compiled_ms": c, "ratio": c / e, "samples": samples}


@torch.inference_mode()
def time_pieces(model, pieces, num_tokens: int, reps: int = 5) -> float:
    """ms of the non-attention parts of every layer at ``num_tokens`` rows (q stands in for attention)."""
    positions = torch.arange(num_tokens)
    cos, sin = model.rotary(positions)
    h = torch.randn(num_tokens, model.config.hidden_size, dtype=model.config.dtype)
    start = time.perf_counter()
    for _ in range(reps):
        for layer in model.layers:
            q, _, _ = pieces.before_attention(layer, h, cos, sin)
            pieces.after_attention(layer, h, q)
    return (time.perf_counter() - start) / reps * 1e3


def pieces_rows(model, compiled, sizes=(32, 256, 2048), samples: int = 5) -> list[dict]:
    from pdserve.engine.models.llama import EAGER_PIECES

    rows = []
    for n in sizes:
        ms = {"eager": [], "compiled": []}
        for _ in range(samples):
            ms["compiled"].append(time_pieces(model, compiled.pieces, n))
            ms["eager"].append(time_pieces(model, EAGER_PIECES, n))
        e, c = statistics.median(ms["eager"]), statistics.median(ms["compiled"])
        rows.append({"shape": f"layers only, {n} tok", "eager_ms": e, "compiled_ms": c, "ratio": c / e,
                     "samples": samples})
        _print(rows[-1])
    return rows


def run(model_dir: str, batches: list[int], context: int, samples: int) -> tuple[float, list[dict]]:
    from pdserve.engine import LLM

    decode_steps = 2 * samples + 2
    most = max(batches)
    kv_bytes = _kv_bytes(model_dir, most * (context + decode_steps + 2 * most * context // 2048 + 32))
    t = time.perf_counter()
    llm = LLM(model_dir, max_num_seqs=max(batches), max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=kv_bytes, max_model_len=2048, torch_compile=True, dtype="float32")
    startup = time.perf_counter() - t
    print(f"engine start-up with compile: {startup:.1f} s", flush=True)
    runner, vocab, g = llm.engine.runner, llm.engine.model_config.vocab_size, torch.Generator().manual_seed(0)
    compiled, timer = runner.compiled, Timer(runner)
    print(f"the engine runs steps of >= {compiled.min_tokens} tokens compiled; timed here: every size", flush=True)
    compiled.min_tokens = 2                     # this bench measures where that threshold belongs
    rows = pieces_rows(runner.model, compiled)
    time_prefill(llm, timer, g, vocab)                                      # first-call costs, both modes
    rows += [{"shape": "prefill 4x512", **ab(runner, compiled, lambda: time_prefill(llm, timer, g, vocab),
                                            max(3, samples // 3))}]
    _print(rows[-1])
    for b in batches:
        ids = start_decodes(llm, g, vocab, b, context)
        time_decode(llm, timer)                                             # first-call costs of decode
        rows.append({"shape": f"decode {b}x{context}", **ab(runner, compiled, lambda: time_decode(llm, timer),
                                                             samples)})
        assert len(llm.engine.scheduler.running) == b, "a sequence finished while the decode steps were timed"
        _print(rows[-1])
        for rid in ids:
            llm.engine.abort_request(rid)
        timer.take()
    llm.shutdown()
    return startup, rows


def _kv_bytes(model_dir: str, tokens: int) -> int:
    from pdserve.engine.models.model_config import ModelConfig

    c = ModelConfig.from_dir(model_dir, dtype="float32")
    return tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4 + (64 << 20)


def _print(r: dict) -> None:
    print(f"{r['shape']:>22}: eager {r['eager_ms']:8.1f} ms  compiled {r['compiled_ms']:8.1f} ms  "
          f"ratio {r['ratio']:.2f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir or short name (default: a 4-layer hidden-256 tiny Llama)")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--context", type=int, default=550)
    p.add_argument("--samples", type=int, default=15, help="decode steps timed per mode (prefill: a third)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("pdserve.engine.runner.compile").setLevel(logging.INFO)      # the start-up compile time
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread", flush=True)
    with tempfile.TemporaryDirectory() as d:
        model = _model_dir(args.model, d)
        startup, rows = run(model, args.batch, args.context, args.samples)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model or "tiny-4x256", "torch": torch.__version__, "startup_s": startup,
                       "rows": rows}, f, indent=1)


def _model_dir(name: str | None, tmp: str) -> str:
    if name is None:
        from pdserve.engine.checkpoints.tiny_model import make_tiny_model

        return str(make_tiny_model(tmp, arch="llama", seed=0, num_layers=4, hidden_size=256,
                                   max_position_embeddings=2048))
    from pdserve.engine.node import resolve_model

    return str(resolve_model(name))


if __name__ == "__main__":
    main()
