"""Config and environment values are validated once, with messages naming the flag or variable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.config import CacheConfig, ConfigError, SchedulerConfig
from pdserve.engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("make, flag", [
    (lambda: CacheConfig(block_size=12), "--block-size"),
    (lambda: CacheConfig(num_gpu_blocks_override=1), "--num-gpu-blocks-override"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "--max-num-batched-tokens"),
    (lambda: SchedulerConfig(max_num_seqs=0), "--max-num-seqs"),
])
def test_bad_config_names_the_flag(make, flag):
    with pytest.raises(ConfigError, match=flag):
        make()


@pytest.mark.parametrize("kwargs, text", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"logprobs": 50}, "logprobs must be in \\[0, 20\\], got 50"),
])
def test_bad_sampling_params(kwargs, text):
    with pytest.raises(SamplingParamsError, match=text):
        SamplingParams(**kwargs)


def test_bad_env_value_is_rejected():
    proc = subprocess.run([sys.executable, "-c", "import pdserve.engine.envs"], capture_output=True, text=True,
                          env={"PDSERVE_NUM_THREADS": "zero", "PATH": ""})
    assert proc.returncode != 0 and "PDSERVE_NUM_THREADS='zero' is not an integer" in proc.stderr
