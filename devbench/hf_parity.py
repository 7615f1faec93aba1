"""The engine's greedy tokens against HF transformers' on tiny generated models (run by ``bench/gpu_check.sh``).

    python devbench/hf_parity.py --device cuda --dtype float32 --check exact
    python devbench/hf_parity.py --device cuda --dtype bfloat16 --check agreement --max-tokens 512

``exact`` (fp32): llama, qwen2, qwen3 and mistral, prompts of 1, 17 and 300 tokens, 12 greedy tokens each;
every token must equal HF's (one line per arch: EQUAL / DIFFERENT).

``agreement`` (bf16, the GPU default): one long greedy run per prompt (lengths 5 and 200), batched in the
engine (CUDA graphs on, unless --enforce-eager) and one at a time in HF, both in --dtype. Two bf16
implementations round differently, so the runs may part where two tokens are nearly tied. Each prompt
reports how many leading tokens agree and, at the first divergence, both tokens and HF's margin there: HF's
top logit minus the logit HF gives the engine's token, on the shared prefix, also in units of one --dtype ulp
at that top logit (bf16: 0.125 for logits in [16, 32)). A divergence within --max-margin-ulps is a near-tie
(rounding): both go on from HF's token (the engine and HF run again from there) and the rest of the run is
compared the same way, so every one of the tokens is checked; a larger margin anywhere fails the check. Exit
status 0 when every check passes.

The engine runs with --attention-backend (default: the device's own; the CPU dry run of gpu_check.sh uses
triton under TRITON_INTERPRET=1 for ``exact`` and torch for ``agreement``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--check", default="exact", choices=["exact", "agreement"])
    p.add_argument("--archs", default=None, help="comma-separated (exact: all four; agreement: llama)")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per prompt (exact 12, agreement 512)")
    p.add_argument("--max-margin-ulps", type=float, default=4.0,
                   help="agreement: the largest HF logit margin at a divergence (in ulps of HF's top logit in --dtype) "
                        "that still counts as a near-tie")
    p.add_argument("--model-root", default="/tmp/gm")
    return p.parse_args(argv)


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()


def load_pair(arch: str, args, max_model_len: int):
    """-> (engine LLM, HF model) on the same generated weights, both in --dtype on --device."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine import LLM
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    model_dir = make_tiny_model(Path(args.model_root) / arch, arch=arch, seed=0)
    llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, max_num_seqs=16, max_model_len=max_model_len)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype))
    return llm, ref.to(args.device).eval()


@torch.inference_mode()
def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``n`` tokens (eos is just another token)."""
    ids = torch.tensor([prompt], device=ref.device)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from pdserve.engine import SamplingParams

    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


@torch.inference_mode()
def hf_margin(ref, prefix: list[int], theirs: int, ours: int) -> tuple[float, float]:
    """After ``prefix``: (HF's logit of its own next token minus its logit of ours, one ulp of the former in
    HF's dtype)."""
    logits = ref(torch.tensor([prefix], device=ref.device)).logits[0, -1]
    top = float(logits[theirs])
    ulp = torch.finfo(logits.dtype).eps * 2.0 ** torch.tensor(abs(top) or 1.0).log2().floor().item()
    return top - float(logits[ours]), ulp


def describe(llm) -> str:
    runner = llm.engine.runner
    return f"backend {runner.attention_backend}, graphs {'on' if runner.graphs is not None else 'off'}"


def exact(args) -> bool:
    """fp32 parity: every token of every prompt equals HF's, for each arch."""
    ok_all, n = True, args.max_tokens or 12
    for arch in (args.archs.split(",") if args.archs else ARCHS):
        llm, ref = load_pair(arch, args, max_model_len=512)
        prompts = [random_prompt(ref.config.vocab_size, k, seed=k) for k in (1, 17, 300)]
        ok = engine_greedy(llm, prompts, n) == [hf_greedy(ref, p, n) for p in prompts]
        print(f"{args.device} {args.dtype} parity {arch} ({describe(llm)}): {'EQUAL' if ok else 'DIFFERENT'}",
              flush=True)
        ok_all &= ok
        llm.shutdown()
    return ok_all


def agreement(args) -> bool:
    """A long greedy run per prompt, compared to its end: each divergence judged, a near-tie passed over."""
    ok_all, n = True, args.max_tokens or 512
    for arch in (args.archs.split(",") if args.archs else ("llama",)):
        llm, ref = load_pair(arch, args, max_model_len=200 + n + 8)
        prompts = [random_prompt(ref.config.vocab_size, k, seed=k) for k in (5, 200)]
        for prompt, ours in zip(prompts, engine_greedy(llm, prompts, n)):
            ok_all &= follow(args, arch, llm, ref, prompt, ours, n)
        llm.shutdown()
    return ok_all


def follow(args, arch, llm, ref, prompt, ours, n: int) -> bool:
    """Compare the engine's run ``ours`` with HF's over all ``n`` tokens; -> whether it passes. At a divergence
    within the near-tie margin both go on from HF's token (the engine and HF run again from there), so a tie
    early in the run does not leave the rest unchecked; a divergence past the margin fails. One line per
    near-tie, then one verdict line per prompt (EQUAL / NEAR-TIE / DIVERGED)."""
    head = f"{args.device} {args.dtype} agreement {arch} prompt {len(prompt)} ({describe(llm)}):"
    done, ties, first = [], 0, None         # done: the compared tokens (HF's at each near-tie)
    while len(done) < n:
        theirs = hf_greedy(ref, prompt + done, n - len(done))
        i = first_divergence(ours, theirs)
        if i is None:
            if len(ours) != len(theirs):
                print(f"{head} the engine gave {len(done) + len(ours)} of {n} tokens: DIVERGED", flush=True)
                return False
            break
        at, first = len(done) + i, first if first is not None else len(done) + i
        margin, ulp = hf_margin(ref, prompt + done + theirs[:i], theirs[i], ours[i])
        where = f"at {at} engine {ours[i]} vs HF {theirs[i]}, HF margin {margin:.4f} = {margin / ulp:.1f} ulp"
        if margin > args.max_margin_ulps * ulp:
            print(f"{head} first {first}/{n} tokens agree, {ties} near-tie(s) passed; {where} "
                  f"(near-tie <= {args.max_margin_ulps:g}): DIVERGED", flush=True)
            return False
        ties += 1
        print(f"{head} near-tie {where}; both go on from HF's token", flush=True)
        done += theirs[:i + 1]
        ours = engine_greedy(llm, [prompt + done], n - len(done))[0] if len(done) < n else []
    if not ties:
        print(f"{head} {n}/{n} tokens agree: EQUAL", flush=True)
    else:
        print(f"{head} all {n} tokens compared: first {first}/{n} agree, then {ties} near-tie(s), HF's token taken "
              f"at each, and no other divergence: NEAR-TIE", flush=True)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    ok = exact(args) if args.check == "exact" else agreement(args)
    print(f"hf_parity {args.check} {args.dtype}: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
