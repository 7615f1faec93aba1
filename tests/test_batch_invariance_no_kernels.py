"""A request's bits do not depend on its batch where the C kernels cannot be built (issue 36, finding 3).

An install without a compiler (a slim image, a wheel without the sources, not x86) runs torch attention and
oneDNN matmuls. One-row matmuls went to F.linear (MKL) and two or more rows to oneDNN, so the same greedy
request alone and beside 7 others gave first logprobs -0.7791517 and -0.7791504. Now one row runs as the first
row of a two-row oneDNN call: alone and in batches of 2, 8 and 31, every token and logprob is the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import json, random, sys
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kernels import cpu_attention, cpu_linear, cpu_ops
    loaded = [m.__name__ for m in (cpu_attention, cpu_linear, cpu_ops) if m.load() is not None]
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_seqs=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(3, 40))] for _ in range(31)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    key = lambda o: [list(o.token_ids), repr(o.logprobs)]
    alone = [key(llm.generate([p], params)[0]) for p in prompts[:3]]
    batched = {n: [key(o) for o in llm.generate(prompts[:n], params)[:3]] for n in (2, 8, 31)}
    print(json.dumps({"loaded": loaded, "alone": alone, "batched": batched}))
""")


def test_without_the_c_kernels_a_request_s_tokens_and_logprobs_do_not_depend_on_its_batch(tiny_llama, tmp_path):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "CC": "/nonexistent/cc",
           "OMP_NUM_THREADS": "1", "PDSERVE_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_llama)], env=env, capture_output=True,
                         text=True, timeout=600, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], got["loaded"]                     # no compiler, an empty cache: no C kernel ran
    for n, rows in got["batched"].items():
        assert rows == got["alone"][:len(rows)], f"batch of {n}"
