"""Incremental detokenization equals a full decode; stop strings cut the text exactly once."""

from __future__ import annotations

from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.tokenizer import load_tokenizer

TEXT = "Hello wörld — naïve café ✓ 日本語 text, with emoji 🙂 and more words."


def test_incremental_equals_full_decode(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add_tokens([t]) for t in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=("café",))
    streamed = ""
    for t in ids:
        streamed += detok.add_tokens([t])
        if detok.stopped_by:
            break
    assert detok.stopped_by == "café"
    assert streamed == detok.text == TEXT[: TEXT.index("café")]


def test_stop_string_included_when_asked(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    detok = IncrementalDetokenizer(tok, stop=("wörld",), include_stop_str_in_output=True)
    for t in tok.encode(TEXT, add_special_tokens=False):
        detok.add_tokens([t])
        if detok.stopped_by:
            break
    assert detok.text == "Hello wörld"


def test_text_held_back_for_a_stop_string_is_emitted_when_the_request_ends_by_length(tiny_llama):
    """The stop matcher holds back a suffix that could start a stop string; a request that then ends by
    ``max_tokens`` must still get that text. Mutation caught: dropping ``detok.flush()`` at the finish
    in ``OutputAssembler._emit_token`` -> the last characters are lost (no other test noticed)."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(block_size=8)))
    prompt = list(range(5, 30))

    def run(rid, **extra):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **extra))
        text, reason = "", None
        while engine.has_unfinished():
            for d in engine.step():
                text += d.new_text
                reason = d.finish_reason or reason
        return text, reason

    full, _ = run("plain")
    assert len(full) >= 2
    stop = full[-2:] + "\x00never"                 # its start matches the text's end; it never completes
    held, reason = run("held", stop=[stop])
    assert (held, reason) == (full, "length")
