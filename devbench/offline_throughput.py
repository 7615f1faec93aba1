"""Offline throughput: pdserve's engine against HF transformers' batched ``generate``, same weights, same run.

    python devbench/offline_throughput.py --model smollm2-135m-instruct [--num-prompts 64] [--hf-batch-size 16]

Fixed-seed random prompts (input 128-512 tokens, output 64-128 tokens, eos ignored). pdserve gets
all prompts at once (continuous batching); HF gets left-padded batches of ``--hf-batch-size`` and runs
each batch to its longest requested output. Both count only the requested output tokens. The two
run alternately ``--rounds`` times (pdserve, HF, pdserve, HF, ...) and each keeps its best round, so
that load from other processes on a shared box biases neither. Prints both tok/s and the ratio, and
writes JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def make_workload(vocab: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(128, 513, (n,), generator=g).tolist()
    out_lens = torch.randint(64, 129, (n,), generator=g).tolist()
    prompts = [torch.randint(10, vocab - 10, (k,), generator=g).tolist() for k in in_lens]
    return prompts, out_lens


def make_pdserve(model_dir: str, threads: int, device: str = "cpu", dtype: str = "float32"):
    from pdserve.engine import LLM

    return LLM(model_dir, num_threads=threads, max_num_seqs=256, max_num_batched_tokens=2048, device=device,
               dtype=dtype, kv_cache_memory_bytes=2 * 2**30, enable_prefix_caching=False)   # no reuse across rounds


def run_pdserve(llm, prompts, out_lens) -> float:
    from pdserve.engine import SamplingParams

    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in out_lens]
    llm.generate(prompts[:2], params[:2])                      # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == out_lens
    return sum(out_lens) / elapsed


def make_hf(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()


@torch.inference_mode()
def run_hf(model, prompts, out_lens, batch_size: int) -> float:
    from tqdm import tqdm

    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="hf generate"):
        batch, lens = prompts[i:i + batch_size], out_lens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                       do_sample=False, pad_token_id=0)
    return sum(out_lens) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each side keeps its best")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--output", default="results/offline_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)

    from pdserve.engine.node import resolve_model

    model_dir = str(resolve_model(args.model))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    prompts, out_lens = make_workload(vocab, args.num_prompts, args.seed)
    llm = make_pdserve(model_dir, args.num_threads, args.device, args.dtype)
    hf_model = make_hf(model_dir, args.device, args.dtype)
    pd_rounds, hf_rounds = [], []
    for _ in range(args.rounds):
        pd_rounds.append(run_pdserve(llm, prompts, out_lens))
        hf_rounds.append(run_hf(hf_model, prompts, out_lens, args.hf_batch_size))
    pd, hf = max(pd_rounds), max(hf_rounds)
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "num_prompts": args.num_prompts,
              "hf_batch_size": args.hf_batch_size,
              "rounds": args.rounds, "pdserve_rounds_tok_s": [round(x, 2) for x in pd_rounds],
              "hf_rounds_tok_s": [round(x, 2) for x in hf_rounds],
              "threads": args.num_threads, "cpu": platform.processor() or platform.machine(),
              "pdserve_output_tok_s": round(pd, 2), "hf_generate_output_tok_s": round(hf, 2),
              "ratio_pdserve_over_hf": round(pd / hf, 3)}
    print(f"\nhardware: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.num_threads} thread(s)")
    print(f"pdserve          {pd:10.1f} output tok/s")
    print(f"HF generate(bs={args.hf_batch_size}) {hf:8.1f} output tok/s")
    print(f"ratio pdserve/HF {pd / hf:10.2f}x")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    json.dump(result, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
