"""What MLA buys in KV bytes and store-hit TTFT: a DeepSeek-V2-Lite-shaped random model against Llamas of its size.

    python -P devbench/mla_kv.py [--layers 4] [--prompt-len 1024] [--repeats 2] [--output results/mla_kv.json]

Models (random fp32 weights, fixed seed, written once into --workdir):
  deepseek   DeepSeek-V2-Lite's attention: hidden 2048, 16 heads, no q_lora, kv_lora_rank 512, qk_nope 128,
             qk_rope 64, v 128 (576 cached values per token and layer); dense MLP layers of --intermediate
  llama-mha  hidden 2048, 16 heads of 128, 16 KV heads (V2-Lite's head count, plain MHA: 4096 values)
  llama-gqa  the same with 4 KV heads (a GQA model of the same width: 1024 values)
Scaled down from V2-Lite's 27 layers (and MoE) to --layers dense layers so a CPU run takes minutes; bytes per
token scale with the layer count, so the ratios hold for any depth.

For each model, in one process, one thread: the layout's KV bytes per token; the store's bytes per token, summed
from the objects a prefill node published (the seal header aside); TTFT of a fresh node that recomputes the prompt
and of a fresh node that loads it from the store (embedded memory tier: ``store_hit_ttft.py``'s method). Prints a
table with the ratios against deepseek and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_hit_ttft import _engine, _timed  # noqa: E402

MLA = dict(hidden_size=2048, num_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
           qk_rope_head_dim=64, v_head_dim=128)


def make_models(workdir: Path, layers: int, intermediate: int) -> dict[str, Path]:
    from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    specs = {
        "deepseek": lambda d: make_tiny_deepseek(d, "deepseek_v2", 0, num_layers=layers, intermediate_size=intermediate,
                                                 first_k_dense_replace=layers, **MLA),
        "llama-mha": lambda d: make_tiny_model(d, "llama", 0, num_layers=layers, hidden_size=2048, num_heads=16,
                                               num_kv_heads=16, intermediate_size=intermediate),
        "llama-gqa": lambda d: make_tiny_model(d, "llama", 0, num_layers=layers, hidden_size=2048, num_heads=16,
                                               num_kv_heads=4, intermediate_size=intermediate),
    }
    out = {}
    for name, make in specs.items():
        d = workdir / f"{name}-L{layers}-I{intermediate}"
        out[name] = d if (d / "config.json").exists() else make(d)
    return out


def measure(model_dir: Path, prompt_len: int, repeats: int, chunk: int) -> dict:
    from pdserve.engine.models.model_config import ModelConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvstore.keys import object_key
    from pdserve.kvstore.memory import MemoryTier
    from pdserve.kvstore.seal import SEAL_BYTES
    from pdserve.kvstore.tiered import TieredStore

    config = ModelConfig.from_dir(model_dir)
    layout = config.kv_layout()
    params = sum(_weights(model_dir))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    cold, hit, store_bpt = [], [], []
    for r in range(repeats):
        store = TieredStore(MemoryTier(4 << 30))
        prompt = torch.randint(10, config.vocab_size - 10, (prompt_len,), generator=g).tolist()
        stamps, pf = _timed(_engine(str(model_dir), "prefill", store, chunk), f"p{r}", prompt, one,
                            {"do_remote_decode": True})
        cold.append(stamps[0])
        t = pf.kv_transfer_params
        keys = [object_key(c, layer) for c in t["chunk_keys"] for layer in range(config.num_layers)]
        store_bpt.append(sum(o.numel() - SEAL_BYTES for o in store.get(keys)) / t["num_tokens"])
        stamps, out = _timed(_engine(str(model_dir), "both", store, chunk), f"h{r}", prompt, one)
        assert out.kv_accounting["loaded_tokens"] > 0, out.kv_accounting
        hit.append(stamps[0])
        store.close()
    return {"params_m": round(params / 1e6, 1), "layout": layout.describe(),
            "kv_bytes_per_token": layout.bytes_per_token, "store_bytes_per_token": statistics.median(store_bpt),
            "ttft_recompute_s": statistics.median(cold), "ttft_store_hit_s": statistics.median(hit)}


def _weights(model_dir: Path):
    """The element count of each checkpoint tensor."""
    import math

    from safetensors import safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                yield math.prod(h.get_slice(k).get_shape())


def report(results: dict) -> str:
    base = results["deepseek"]
    lines = ["| model | params (M) | KV B/token | store B/token | x deepseek | TTFT recompute (ms) "
             "| TTFT store hit (ms) | hit speed-up |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['params_m']} | {r['kv_bytes_per_token']} | {r['store_bytes_per_token']:.0f} | "
                     f"{r['store_bytes_per_token'] / base['store_bytes_per_token']:.2f} | "
                     f"{r['ttft_recompute_s'] * 1e3:.0f} | {r['ttft_store_hit_s'] * 1e3:.0f} | "
                     f"{r['ttft_recompute_s'] / r['ttft_store_hit_s']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-chunk-tokens", type=int, default=256)
    ap.add_argument("--workdir", default="/tmp/pdserve-mla-bench")
    ap.add_argument("--output", default="results/mla_kv.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.monotonic()
    models = make_models(Path(args.workdir), args.layers, args.intermediate)
    results = {name: measure(d, args.prompt_len, args.repeats, args.kv_chunk_tokens) for name, d in models.items()}
    table = report(results)
    print(f"\n{args.layers} layers, {args.prompt_len}-token prompt, {platform.machine()} {os.cpu_count()} cores, "
          f"1 thread, fp32, embedded memory store ({time.monotonic() - start:.0f} s)\n{table}")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    json.dump({"layers": args.layers, "prompt_len": args.prompt_len, "repeats": args.repeats,
               "hardware": f"{platform.machine()} {os.cpu_count()} cores", "torch": torch.__version__,
               "models": results}, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
