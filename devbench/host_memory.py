"""Page faults and time of prompt steps with and without pdserve's host-memory tuning (engine/host_memory.py).

    python devbench/host_memory.py [--model DIR] [--prompts 4] [--prompt-len 512] [--rounds 7] [--output F.json]

Each setting runs in its own process (glibc's malloc settings are per process): ``PDSERVE_HOST_MEMORY=tuned``
(pdserve's default) and ``default`` (glibc's own thresholds), alternating, ``--rounds`` times each. A
process builds ``LLM(model)``, runs one warm-up, then times ``--repeats`` one-token generations of the same
prompts (one prompt step each) and counts the minor page faults they cause (``getrusage``). Best round per
setting. Without ``--model`` it makes the tiny model (4 layers, hidden 256) in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time, torch
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
model, n, length, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, max_model_len=2048, enable_prefix_caching=False)
vocab = llm.engine.model_config.vocab_size
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(10, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]
sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
llm.generate(prompts, sp)
f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
for _ in range(repeats):
    llm.generate(prompts, sp)
print(json.dumps({"faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / repeats,
                  "ms": (time.perf_counter() - t0) / repeats * 1e3}))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="host_memory", description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", default="host_memory.json")
    return p.parse_args(argv)


def run_child(setting: str, model: str, args) -> dict:
    env = {**os.environ, "PDSERVE_HOST_MEMORY": setting, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(args.prompts), str(args.prompt_len),
                          str(args.repeats)], env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "tiny")
            subprocess.run([sys.executable, "-m", "pdserve.engine.cli", "make-tiny-model", "--num-layers", "4",
                            "--hidden-size", "256", model], check=True, capture_output=True)
        best: dict[str, dict] = {}
        for r in range(args.rounds):
            for setting in ("tuned", "default"):
                res = run_child(setting, model, args)
                print(f"round {r + 1}/{args.rounds} {setting:8s} {res['ms']:8.1f} ms/step "
                      f"{res['faults']:8.0f} faults/step", flush=True)
                if setting not in best or res["ms"] < best[setting]["ms"]:
                    best[setting] = res
    for setting, res in best.items():
        print(f"best {setting:8s} {res['ms']:8.1f} ms/step {res['faults']:8.0f} faults/step")
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "best": best}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
