"""Structured outputs' cost: output tok/s with half the requests constrained by a JSON schema vs none, same run.

    python devbench/structured_bench.py [--model smollm2-135m-instruct] [--num-prompts 32] [--rounds 2]

Fixed-seed random prompts (input 128-512 tokens), all submitted at once to one offline engine. The "json" run
constrains every other request with a JSON schema (a nested object, an enum, an array, bounded strings:
the grammar decides where the answer ends); the "plain" run sends the same prompts unconstrained, each with
``max_tokens`` and eos ignored set to the length its structured twin produced (the others to fixed-seed
lengths), so both runs produce the same number of tokens per request and per step. A warm-up json run
compiles the grammar (cached afterwards: the figure is the per-token cost of masking, matching and the
per-request matchers) and measures those lengths. The runs alternate ``--rounds`` times; each keeps its best.
Prints both tok/s and the ratio json/plain (the issue's goal: >= 0.90), checks every structured answer
parses, and writes JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "address", "active"],
}


def make_workload(vocab: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(128, 513, (n,), generator=g).tolist()
    out_lens = torch.randint(64, 129, (n,), generator=g).tolist()
    prompts = [torch.randint(10, vocab - 10, (k,), generator=g).tolist() for k in in_lens]
    return prompts, out_lens


def json_params(out_lens: list[int], max_tokens: int):
    """Every other request constrained by SCHEMA (greedy, up to ``max_tokens``); the rest plain."""
    from pdserve.engine import SamplingParams
    from pdserve.engine.structured.spec import StructuredOutputs

    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec) if i % 2 == 0 else
            SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for i, k in enumerate(out_lens)]


def plain_params(lengths: list[int]):
    from pdserve.engine import SamplingParams

    return [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths]


def timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-json-tokens", type=int, default=256)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each side keeps its best")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--output", default="results/structured_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)

    from pdserve.engine import LLM
    from pdserve.engine.node import resolve_model

    model_dir = str(resolve_model(args.model))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    prompts, out_lens = make_workload(vocab, args.num_prompts, args.seed)
    llm = LLM(model_dir, num_threads=args.num_threads, max_num_seqs=256, max_num_batched_tokens=2048,
              device=args.device, dtype=args.dtype, kv_cache_memory_bytes=2 * 2**30, enable_prefix_caching=False)
    with_json = json_params(out_lens, args.max_json_tokens)
    _, warm = timed(llm, prompts, with_json)                 # compiles the grammar; the structured lengths
    lengths = [len(o.token_ids) for o in warm]
    plain = plain_params(lengths)
    rounds = {"plain": [], "json": []}
    for _ in range(args.rounds):
        rate, _ = timed(llm, prompts, plain)
        rounds["plain"].append(rate)
        rate, outs = timed(llm, prompts, with_json)
        rounds["json"].append(rate)
    structured = [o for i, o in enumerate(outs) if i % 2 == 0]
    valid = sum(_parses(o.text) for o in structured)
    best = {k: max(v) for k, v in rounds.items()}
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "num_prompts": args.num_prompts,
              "threads": args.num_threads, "cpu": platform.processor() or platform.machine(),
              "output_tokens": sum(lengths), "structured_requests": len(structured), "structured_valid": valid,
              "structured_finish_stop": sum(o.finish_reason == "stop" for o in structured),
              "rounds_tok_s": {k: [round(x, 2) for x in v] for k, v in rounds.items()},
              "plain_output_tok_s": round(best["plain"], 2), "json_output_tok_s": round(best["json"], 2),
              "ratio_json_over_plain": round(best["json"] / best["plain"], 3)}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    print(f"\nhardware: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.num_threads} thread(s), device {args.device}")
    print(f"{len(structured)} of {args.num_prompts} requests with a JSON schema: {valid} parse, "
          f"{result['structured_finish_stop']} finished with stop; {sum(lengths)} output tokens per run")
    print(f"plain            {best['plain']:10.1f} output tok/s")
    print(f"half JSON schema {best['json']:10.1f} output tok/s")
    print(f"ratio json/plain {best['json'] / best['plain']:10.3f}")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    json.dump(result, open(args.output, "w"), indent=2)
    llm.shutdown()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
