"""Incremental detokenization equals a full decode; stop strings cut the text exactly once."""

from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.tokenizer import load_tokenizer

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
