"""Hostile requests, one per class, with what a node (and the proxy, word for word) must answer (no tests here).

Used by ``test_hostile_requests.py`` against a node with ``--max-model-len 128 --max-request-bytes 1 MiB``
serving a tiny llama (vocabulary 512 tokens, at most 13 characters per token). ``REFUSED``: (name,
path, body, status, words of the message); a body of ``bytes`` is sent raw. ``ACCEPTED``: requests that
must run to completion (name, path, body, same_as_greedy: the text must equal the greedy text).
"""

from __future__ import annotations

MAX_REQUEST_BYTES = 1 << 20
MAX_MODEL_LEN = 128
CMPL, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
PROMPT = "Once upon a time"
BASE = {"prompt": PROMPT, "max_tokens": 4}
USER = [{"role": "user", "content": PROMPT}]


def _nested_in_message(depth: int) -> bytes:
    """A chat body nested ``depth`` levels deep in a message's extra key (which goes to the template as it is)."""
    return b'{"messages": [{"role": "user", "content": "Once upon a time", "extra": ' + b"[" * (depth - 3) + \
        b"]" * (depth - 3) + b'}], "max_tokens": 4, "temperature": 0}'


def _nested(depth: int) -> bytes:
    return b'{"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "extra": ' + b"[" * depth + \
        b"]" * depth + b"}"


REFUSED = [
    ("seed 2^64", CMPL, {**BASE, "seed": 2**64}, 400, ["seed", "less than or equal to 9223372036854775807"]),
    ("seed 2^64-1 with n=2 (seed + 1 overflows)", CMPL, {**BASE, "seed": 2**64 - 1, "n": 2}, 400,
     ["seed", "less than or equal to 9223372036854775807"]),
    ("seed -2^63-1", CMPL, {**BASE, "seed": -2**63 - 1}, 400, ["seed", "greater than or equal to"]),
    ("seed a string", CMPL, {**BASE, "seed": "1e3"}, 400, ["seed", "valid integer"]),
    ("stop id past the vocabulary", CMPL, {**BASE, "stop_token_ids": [600], "min_tokens": 2}, 400,
     ["token id 600 is out of range", "512 tokens"]),
    ("stop id -1", CMPL, {**BASE, "stop_token_ids": [-1], "min_tokens": 2}, 400,
     ["stop_token_ids.0", "greater than or equal to 0"]),
    ("stop ids 2000", CMPL, {**BASE, "stop_token_ids": [1] * 2000}, 400, ["stop_token_ids", "limit is 1024"]),
    ("temperature NaN", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, ["temperature", "finite number"]),
    ("temperature 1e999", CMPL, b'{"prompt": "hi", "temperature": 1e999}', 400, ["temperature", "finite number"]),
    ("temperature 3.4e38 (inf in float32)", CMPL, {**BASE, "temperature": 3.4028235677973366e+38}, 400,
     ["temperature must be at most 1e+06"]),
    ("temperature -1", CMPL, {**BASE, "temperature": -1}, 400, ["temperature must be >= 0, got -1"]),
    ("top_p Infinity", CMPL, b'{"prompt": "hi", "top_p": Infinity}', 400, ["top_p", "finite number"]),
    ("top_p 2", CMPL, {**BASE, "top_p": 2}, 400, ["top_p must be in (0, 1], got 2"]),
    ("min_p -0.5", CMPL, {**BASE, "min_p": -0.5}, 400, ["min_p must be in [0, 1]"]),
    ("repetition_penalty 1e-38", CMPL, {**BASE, "repetition_penalty": 1e-38}, 400,
     ["repetition_penalty must be in [0.001, 1000]"]),
    ("top_k 2^70", CMPL, {**BASE, "top_k": 2**70}, 400, ["top_k", "less than or equal to"]),
    ("max_tokens 2^64", CMPL, {**BASE, "max_tokens": 2**64}, 400, ["max_tokens", "less than or equal to 2147483647"]),
    ("max_tokens 0", CMPL, {**BASE, "max_tokens": 0}, 400, ["max_tokens must be >= 1, got 0"]),
    ("min_tokens 2^40", CMPL, {**BASE, "min_tokens": 2**40}, 400, ["min_tokens", "less than or equal to"]),
    ("n 10^6", CMPL, {**BASE, "n": 10**6}, 400, ["n:", "less than or equal to 16"]),
    ("64 prompts x n=16", CMPL, {**BASE, "prompt": ["hi"] * 64, "n": 16}, 400, ["1024 choices", "limit is 256"]),
    ("100 prompts", CMPL, {**BASE, "prompt": ["hi"] * 100}, 400, ["prompt", "limit is 64"]),
    ("logprobs 10^20", CMPL, {**BASE, "logprobs": 10**20}, 400, ["logprobs", "less than or equal to"]),
    ("top_logprobs 21", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     ["logprobs must be in [0, 20], got 21"]),
    ("100 stop strings", CMPL, {**BASE, "stop": ["x"] * 100}, 400, ["stop", "limit is 64"]),
    ("a 5000-char stop string", CMPL, {**BASE, "stop": ["x" * 5000]}, 400, ["stop.0", "at most 1024 characters"]),
    ("an empty stop string", CMPL, {**BASE, "stop": [""]}, 400, ["stop strings must be non-empty"]),
    ("logit_bias value 1000", CMPL, {**BASE, "logit_bias": {"5": 1000}}, 400, ["logit_bias.5", "less than or equal"]),
    ("logit_bias key 'abc'", CMPL, {**BASE, "logit_bias": {"abc": 1}}, 400, ["logit_bias.abc", "pattern"]),
    ("logit_bias 2000 keys", CMPL, {**BASE, "logit_bias": {str(i): 1 for i in range(2000)}}, 400, ["limit is 1024"]),
    ("logit_bias id past the vocabulary", CMPL, {**BASE, "logit_bias": {"5": 1, "512": -100}}, 400,
     ["token id 512 is out of range", "512 tokens"]),
    ("logit_bias id 2^40", CMPL, {**BASE, "logit_bias": {str(2**40): 1}}, 400, ["logit_bias", "pattern"]),
    ("logit_bias id twice ('5', '05')", CHAT, {"messages": USER, "logit_bias": {"5": 1, "05": 2}}, 400,
     ["logit_bias names a token id twice: [5, 5]"]),
    ("presence_penalty 2.5", CMPL, {**BASE, "presence_penalty": 2.5}, 400,
     ["presence_penalty must be in [-2, 2], got 2.5"]),
    ("frequency_penalty -3", CHAT, {"messages": USER, "frequency_penalty": -3}, 400,
     ["frequency_penalty must be in [-2, 2], got -3"]),
    ("frequency_penalty NaN", CMPL, b'{"prompt": "hi", "frequency_penalty": NaN}', 400,
     ["frequency_penalty", "finite number"]),
    ("prompt id 2^40", CMPL, {**BASE, "prompt": [5, 2**40]}, 400, ["prompt.1", "less than or equal to 2147483647"]),
    ("prompt id past the vocabulary", CMPL, {**BASE, "prompt": [5, 512]}, 400, ["token id 512 is out of range"]),
    ("prompt of 200k chars", CMPL, {**BASE, "prompt": "word " * 40_000}, 400,
     ["prompt has 200000 characters", "--max-model-len 128"]),
    ("a prompt of 200 tokens (its characters could fit)", CMPL, {**BASE, "prompt": "word " * 200}, 400,
     ["tokens; --max-model-len is 128"]),
    ("a chat of 200 tokens (its characters could fit)", CHAT,
     {"messages": [{"role": "user", "content": "word " * 200}]}, 400, ["tokens; --max-model-len is 128"]),
    ("5000 messages", CHAT, {"messages": USER * 5000}, 400, ["messages", "limit is 4096"]),
    ("300 content parts", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300}]},
     400, ["messages.0.content", "limit is 256"]),
    ("an image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     ["only 'text' parts"]),
    ("a 1000-char role", CHAT, {"messages": [{"role": "r" * 1000, "content": "hi"}]}, 400,
     ["messages.0.role", "at most 256 characters"]),
    ("chat of 200k chars", CHAT, {"messages": [{"role": "user", "content": "word " * 40_000}]}, 400,
     ["prompt has 200000 characters"]),
    ("JSON nested 100000 deep", CMPL, _nested(100_000), 400, ["nests JSON 100001 levels deep", "limit is 32"]),
    ("JSON nested 40 deep", CMPL, _nested(40), 400, ["nests JSON 41 levels deep", "limit is 32"]),
    ("an unknown field nested 32 deep", CMPL, _nested(31), 400, ["unknown field 'extra'", "does not support it"]),
    ("body over --max-request-bytes", CMPL, {**BASE, "pad": "x" * (MAX_REQUEST_BYTES + 10)}, 413,
     ["--max-request-bytes is 1048576"]),
    ("an integer of 5000 digits", CMPL, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, []),
    ("a JSON array body", CMPL, b"[1, 2, 3]", 400, ["valid dictionary"]),
    ("not JSON", CMPL, b"{nope", 400, ["not valid JSON"]),
]

NODE_ONLY_REFUSED = [        # the proxy answers these itself, so they are probed at the node only
    ("/tokenize of 200k chars", TOK, {"prompt": "word " * 40_000}, 400, ["prompt has 200000 characters"]),
    ("/detokenize id 2^40", DETOK, {"tokens": [2**40]}, 400, ["tokens.0", "less than or equal"]),
    ("/detokenize id past the vocabulary", DETOK, {"tokens": [512]}, 400, ["token id 512 is out of range"]),
    ("sampler_draws 2^40", CMPL, {**BASE, "prompt_token_ids": [5, 6, 7], "kv_transfer_params": {
        "do_remote_prefill": True, "first_token_id": 5, "sampler_draws": 2**40}}, 400, ["sampler_draws"]),
    ("sampler_draws 2^20 (slow to skip)", CMPL, {**BASE, "prompt_token_ids": [5, 6, 7], "kv_transfer_params": {
        "do_remote_prefill": True, "first_token_id": 5, "sampler_draws": 2**20}}, 400, ["sampler_draws"]),
    ("first_token_id past the vocabulary", CMPL, {**BASE, "prompt_token_ids": [5, 6, 7], "kv_transfer_params": {
        "do_remote_prefill": True, "first_token_id": 10**6}}, 400, ["first_token_id 1000000", "vocabulary"]),
    ("first_token_top_logprobs id negative", CMPL, {**BASE, "prompt_token_ids": [5, 6, 7], "logprobs": 1,
        "kv_transfer_params": {"first_token_id": 5, "first_token_top_logprobs": [[-5, -1.0]]}}, 400,
     ["first_token_top_logprobs id -5", "vocabulary"]),
    ("first_token_logprob positive", CMPL, {**BASE, "prompt_token_ids": [5, 6, 7], "logprobs": 1,
        "kv_transfer_params": {"first_token_id": 5, "first_token_logprob": 3.0}}, 400, ["logprobs must be <= 0"]),
    ("first_token_id negative", CMPL, {**BASE, "prompt_token_ids": [5, 6, 7], "kv_transfer_params": {
        "first_token_id": -1}}, 400, ["first_token_id -1", "vocabulary"]),
]

ACCEPTED = [
    ("seed 2^63-1 with n=4 (seed + choice index)", CMPL, {**BASE, "seed": 2**63 - 1, "n": 4, "temperature": 1.0},
     False),
    ("seed -2^63", CMPL, {**BASE, "seed": -2**63, "temperature": 1.0}, False),
    ("temperature 1e-40 (greedy)", CMPL, {**BASE, "temperature": 1e-40, "seed": 3}, True),
    ("temperature 1e-6 (greedy)", CMPL, {**BASE, "temperature": 1e-6}, True),
    ("temperature 1e6", CMPL, {**BASE, "temperature": 1e6, "seed": 1}, False),
    ("repetition_penalty 1000", CMPL, {**BASE, "repetition_penalty": 1000.0, "temperature": 0}, False),
    ("stop ids in the vocabulary with min_tokens", CMPL, {**BASE, "stop_token_ids": [0, 511], "min_tokens": 3}, False),
    ("top_k 10^9", CMPL, {**BASE, "top_k": 10**9, "seed": 1}, False),
    ("logit_bias {}", CMPL, {**BASE, "logit_bias": {}, "temperature": 0}, True),
    ("logit_bias at the edges", CMPL, {**BASE, "logit_bias": {"0": -100, "511": 100}, "temperature": 0}, False),
    ("penalties and logit_bias null", CHAT, {"messages": USER, "max_tokens": 4, "temperature": 0, "logit_bias": None,
                                             "presence_penalty": None, "frequency_penalty": None}, False),
    ("presence and frequency penalties at -2 and 2", CMPL,
     {**BASE, "presence_penalty": -2, "frequency_penalty": 2, "temperature": 0}, False),
    ("JSON nested 32 deep (a message's extra key)", CHAT, _nested_in_message(32), False),
]
