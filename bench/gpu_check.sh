#!/usr/bin/env bash
# The device check for a session that is lent a GPU (run through the device tool, from the repo root):
#   1. greedy token ids of the engine on CUDA (fp32) == HF transformers on CUDA, every architecture
#   2. offline throughput on CUDA, pdserve vs HF generate, on a generated ~75M-parameter Llama
# Needs: torch with CUDA, transformers, safetensors, tokenizers, xxhash, tqdm; msgspec as a wheel in .whl/.
set -euo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gm
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/parity.txt"
import sys, torch
sys.path.insert(0, "tests")
from hf_reference import random_prompt
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tiny_model import make_tiny_model
from transformers import AutoModelForCausalLM
for arch in ("llama", "qwen2", "qwen3", "mistral"):
    d = make_tiny_model(f"/tmp/gm/{arch}", arch=arch, seed=0)
    llm = LLM(str(d), device="cuda", dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).cuda().eval()
    ok = True
    for n in (1, 17, 300):
        p = random_prompt(ref.config.vocab_size, n, seed=n)
        [o] = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        h = ref.generate(torch.tensor([p]).cuda(), attention_mask=torch.ones(1, n, dtype=torch.long).cuda(),
                         max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        ok &= o.token_ids == h
    print(f"cuda parity {arch}: {'EQUAL' if ok else 'DIFFERENT'}")
PY
python3 -c "from pdserve.engine.tiny_model import make_tiny_model as m; m('/tmp/gm/big', arch='llama', seed=0, num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048)"
for dt in float32 bfloat16; do
  python3 bench/offline_throughput.py --model /tmp/gm/big --device cuda --dtype $dt --rounds 2 \
    --output "$OUT/offline_cuda_$dt.json" 2>&1 | grep -v "it/s\]" | tail -6
done
