"""The printed table (vLLM's rows, order and formats), the result file name, and the datasets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdserve.bench.datasets import DatasetConfig, sample_requests
from pdserve.bench.metrics import RequestOutput, calculate_metrics
from pdserve.bench.report import RunInfo, format_table, result_filename, result_json
from pdserve.engine.text.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data"


def _metrics():
    outs = [RequestOutput(success=True, latency=0.5, output_tokens=5, ttft=0.1, itl=[0.1] * 4, prompt_len=20),
            RequestOutput(success=False, error="x")]
    return calculate_metrics(outs, 2.0, [99.0], {"ttft": 200.0}), outs


def test_table_rows_order_and_formats():
    m, _ = _metrics()
    run = RunInfo("openai", "m", "m", 2, request_rate=4.0, burstiness=1.0, max_concurrency=8, duration_s=2.0,
                  goodput={"ttft": 200.0})
    lines = format_table(m, run).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    labels = [line[:40].rstrip() for line in lines[1:14]]
    assert labels == ["Successful requests:", "Failed requests:", "Maximum request concurrency:",
                      "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:",
                      "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                      "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
                      "Peak concurrent requests:", "Total token throughput (tok/s):"]
    assert lines[1] == "Successful requests:                     1         "
    assert lines[4] == "Request rate configured (RPS):           4.00      "
    assert lines[12] == "Peak concurrent requests:                1.00      "
    assert lines[14] == "---------------Time to First Token----------------"
    assert lines[15] == "Mean TTFT (ms):                          100.00    "
    assert lines[17].startswith("P99 TTFT (ms):")
    assert lines[18] == "-----Time per Output Token (excl. 1st token)------"
    assert lines[22] == "---------------Inter-token Latency----------------"
    assert lines[-1] == "=" * 50 and len(lines) == 27


def test_table_without_optional_rows_and_result_values():
    m, outs = _metrics()
    run = RunInfo("openai", "org/m", "tok", 2, math.inf, 1.0, None, 2.0)
    labels = [line[:40].rstrip() for line in format_table(m, run).splitlines()]
    assert "Maximum request concurrency:" not in labels and "Request rate configured (RPS):" not in labels
    assert "Request goodput (req/s):" not in labels
    result = result_json(m, run, outs, date="20260101-000000")
    assert result["request_rate"] == "inf" and result["request_goodput"] is None
    assert result["completed"] == 1 and result["failed"] == 1 and result["mean_tpot_ms"] == pytest.approx(100.0)
    assert result_filename(run, "D") == "openai-infqps-m-D.json"
    assert result_filename(RunInfo("openai", "m", "m", 2, 2.0, 1.0, 4, 1.0, label="x"), "D") == \
        "x-2.0qps-concurrency4-m-D.json"


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


def test_random_dataset_lengths_prefix_and_seed(tok):
    cfg = DatasetConfig(num_prompts=20, random_input_len=40, random_output_len=10, random_range_ratio=0.5,
                        random_prefix_len=8, seed=3)
    reqs = sample_requests(cfg, tok)
    assert len(reqs) == 20 and all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert all(r.prompt_len <= 8 + 60 for r in reqs) and len({r.prompt for r in reqs}) == 20
    head = tok.encode(reqs[0].prompt, add_special_tokens=False)[:6]
    assert all(tok.encode(r.prompt, add_special_tokens=False)[:6] == head for r in reqs)   # shared prefix
    assert sample_requests(cfg, tok) == reqs                                                # fixed seed


def test_prefix_repetition_groups(tok):
    cfg = DatasetConfig(name="prefix_repetition", num_prompts=12, prefix_repetition_prefix_len=32,
                        prefix_repetition_suffix_len=16, prefix_repetition_num_prefixes=3,
                        prefix_repetition_output_len=7)
    reqs = sample_requests(cfg, tok)
    heads = [tuple(tok.encode(r.prompt, add_special_tokens=False)[:24]) for r in reqs]
    assert sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]
    with pytest.raises(ValueError, match="multiple of"):
        sample_requests(DatasetConfig(name="prefix_repetition", num_prompts=10, prefix_repetition_num_prefixes=3), tok)


def test_multi_round_history_grows(tok):
    cfg = DatasetConfig(name="multi-round", multi_round_users=3, multi_round_rounds=3, multi_round_system_len=20,
                        multi_round_question_len=8, multi_round_answer_len=6)
    reqs = sample_requests(cfg, tok)
    assert [r.round for r in reqs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for user in range(3):
        prompts = [reqs[r * 3 + user].prompt for r in range(3)]
        lens = [reqs[r * 3 + user].prompt_len for r in range(3)]
        assert lens[0] < lens[1] < lens[2]
        assert prompts[1].startswith(prompts[0][:-8]) and prompts[2].startswith(prompts[1][:-8])


def test_multi_round_generated_history_names_sessions_and_questions(tok):
    """``generated``: the same draws as ``synthetic`` (round 0's prompts are equal), each request names its user
    and the question it adds (the runner builds later prompts from the server's answers); a bad value is a
    ValueError naming it."""
    base = dict(name="multi-round", multi_round_users=2, multi_round_rounds=2, multi_round_system_len=20,
                multi_round_question_len=8, multi_round_answer_len=6)
    synthetic = sample_requests(DatasetConfig(**base), tok)
    generated = sample_requests(DatasetConfig(**base, multi_round_history="generated"), tok)
    assert [r.prompt for r in generated[:2]] == [r.prompt for r in synthetic[:2]]
    assert [(r.round, r.session) for r in generated] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.session == -1 and r.turn == "" for r in synthetic)
    for r in generated:
        assert r.turn and r.prompt.endswith(r.turn) and len(tok.encode(r.turn, add_special_tokens=False)) <= 8
    with pytest.raises(ValueError, match="--multi-round-history 'echo'"):
        sample_requests(DatasetConfig(**base, multi_round_history="echo"), tok)


def test_long_doc_rounds_reuse_documents(tok):
    cfg = DatasetConfig(name="long-doc", long_doc_num_docs=2, long_doc_len=64, long_doc_question_len=8,
                        long_doc_rounds=2, long_doc_output_len=4)
    reqs = sample_requests(cfg, tok)
    assert [r.round for r in reqs] == [0, 0, 1, 1]
    for d in range(2):
        cold, warm = reqs[d].prompt, reqs[2 + d].prompt
        assert cold != warm and cold[:40] == warm[:40]


def test_sharegpt_file(tok):
    cfg = DatasetConfig(name="sharegpt", path=str(DATA / "sharegpt_sample.json"), num_prompts=5)
    reqs = sample_requests(cfg, tok)
    assert len(reqs) == 5 and all(r.prompt.startswith("Question number") for r in reqs)
    assert all(r.expected_output_len >= 4 for r in reqs)
    with pytest.raises(ValueError, match="only 6 usable"):
        sample_requests(DatasetConfig(name="sharegpt", path=cfg.path, num_prompts=7), tok)
    with pytest.raises(ValueError, match="--dataset-path"):
        sample_requests(DatasetConfig(name="sharegpt"), tok)
