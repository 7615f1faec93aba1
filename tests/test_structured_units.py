"""Structured outputs' pieces without an engine (issue 37): the compiler's cache and threads, the bitmask.

- ``GrammarCompiler``: one compile per constraint however it is spelled (``spec.key``), shared by callers that
  come while it runs; an LRU bounded by ``cache_size``; a failed compile names the kind and is not cached;
  compiles run on the pool, never in the caller.
- ``apply_bitmask``: xgrammar's bitmask, filled by a real matcher over a small vocabulary, applied to a batch
  equals a torch reference (each bit decoded by hand), rows without a constraint untouched; the rows survive a
  trip through bytes (a tp x pp node's ``StepRequest``).
- ``build_grammar``: choices with quotes, backslashes, newlines and non-ASCII text are matched exactly.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from pdserve.engine.parallel import messages as m  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.structured.bitmask import GrammarBitmask, apply_bitmask  # noqa: E402
from pdserve.engine.structured.compiler import GrammarCompiler  # noqa: E402
from pdserve.engine.structured.grammar import StructuredOutputError, build_grammar  # noqa: E402
from pdserve.engine.structured.spec import StructuredOutputs  # noqa: E402

# a vocabulary of single characters and a few words; 99 pads it past a multiple of 32 (ids 70..98 unused)
VOCAB = ["<eos>"] + list('{}[]",: 0123456789abcdefghijklmnopqrstuvwxyz') + ["true", "false", "null", "ab", '"a"',
                                                                             "yes", "no", "\\", "\n"]
VOCAB_SIZE = 99
EOS = 0


def _info():
    return xgr.TokenizerInfo(VOCAB, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])


@pytest.fixture()
def compiler():
    c = GrammarCompiler(_info, max_workers=2, cache_size=2)
    yield c
    c.shutdown()


def test_one_compile_per_constraint_however_spelled(compiler):
    a = compiler.submit(StructuredOutputs(json='{"type": "object", "required": ["a"], "properties": {"a": {}}}'))
    b = compiler.submit(StructuredOutputs(json='{"properties":{"a":{}},"required":["a"],"type":"object"}'))
    assert a is b and compiler.num_compiles == 1
    assert isinstance(a.result(timeout=30), xgr.CompiledGrammar)
    compiler.submit(StructuredOutputs(regex="[a-c]+")).result(timeout=30)
    assert compiler.num_compiles == 2


def test_callers_share_a_running_compile_and_it_runs_off_their_thread(compiler):
    gate, seen = threading.Event(), []
    compiler.before_compile = lambda spec: (seen.append(threading.current_thread().name), gate.wait(30))
    first = compiler.submit(StructuredOutputs(choice=("yes", "no")))
    second = compiler.submit(StructuredOutputs(choice=("yes", "no")))
    assert first is second and not first.done()         # submit returned while the compile is held
    gate.set()
    first.result(timeout=30)
    assert compiler.num_compiles == 1 and seen and seen[0].startswith("grammar")


def test_lru_keeps_cache_size_entries(compiler):
    specs = [StructuredOutputs(regex=r) for r in ("a+", "b+", "c+")]
    for spec in specs:
        compiler.submit(spec).result(timeout=30)
    assert compiler.num_compiles == 3
    compiler.submit(specs[2]).result(timeout=30)          # recent: cached
    assert compiler.num_compiles == 3
    compiler.submit(specs[0]).result(timeout=30)          # evicted by the third: compiled again
    assert compiler.num_compiles == 4


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(regex="[a-"), "invalid regex"),
    (StructuredOutputs(json='{"type": "object", "properties": 5}'), "invalid JSON schema"),
    (StructuredOutputs(grammar='root ::= missing'), "invalid EBNF grammar"),
])
def test_a_failed_compile_names_its_kind_and_is_not_cached(compiler, spec, words):
    with pytest.raises(StructuredOutputError, match=words):
        compiler.submit(spec).result(timeout=30)
    with pytest.raises(StructuredOutputError):
        compiler.submit(spec).result(timeout=30)
    assert compiler.num_compiles == 2


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> torch.Tensor:
    """-inf wherever bit j of the row's bitmask is 0, on the given rows only; decoded one bit at a time."""
    out = logits.clone()
    for i in rows:
        for j in range(vocab):
            word = int(bitmask[i, j // 32]) & 0xFFFFFFFF
            if not (word >> (j % 32)) & 1:
                out[i, j] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_from_matchers_equals_a_torch_reference(compiler, dtype):
    specs = [StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
             StructuredOutputs(choice=("yes", "no")), StructuredOutputs(regex="[0-9]{2}x")]
    matchers = {f"r{i}": xgr.GrammarMatcher(compiler.submit(s).result(timeout=30)) for i, s in enumerate(specs)}
    matchers["r0"].accept_string('{"a": 1')                  # mid-way: digits, "}" or ","
    ids = ["plain0", "r0", "plain1", "r1", "r2"]              # the batch's rows; plain ones have no constraint
    mask = GrammarBitmask.allocate(["r2", "r0", "r1"], VOCAB_SIZE)  # its own row order
    for rid in mask.rows:
        matchers[rid].fill_next_token_bitmask(mask.mask, mask.rows[rid])
    logits = torch.randn(len(ids), VOCAB_SIZE, generator=torch.Generator().manual_seed(0)).to(dtype)
    aligned = torch.full((len(ids), mask.mask.shape[1]), -1, dtype=torch.int32)
    for i, rid in enumerate(ids):
        if rid in mask.rows:
            aligned[i] = mask.mask[mask.rows[rid]]
    expected = _reference_mask(logits, aligned, [1, 3, 4], VOCAB_SIZE)
    apply_bitmask(logits, ids, mask)
    assert torch.equal(logits, expected)
    allowed = {rid: {VOCAB[j] for j in range(len(VOCAB)) if logits[ids.index(rid), j] > float("-inf")}
               for rid in ("r1", "r2")}
    assert allowed == {"r1": {"y", "n", "yes", "no"}, "r2": set("0123456789")}
    assert torch.isfinite(logits[[0, 2]].float()).all()       # unconstrained rows untouched


def test_bitmask_rows_survive_bytes(compiler):
    """A row as a tp x pp node sends it: bytes in a StepRequest, through msgspec, back to a mask."""
    matcher = xgr.GrammarMatcher(compiler.submit(StructuredOutputs(regex="ab+")).result(timeout=30))
    mask = GrammarBitmask.allocate(["x", "y"], VOCAB_SIZE)
    matcher.fill_next_token_bitmask(mask.mask, 1)
    sent = [m.StepRequest(rid, [1], 0, [0], True, SamplingParams(structured=StructuredOutputs(regex="ab+")),
                          bitmask=mask.row_bytes(rid)) for rid in ("y", "x")]
    got = m.decode_driver_message(m.encode(m.StepMessage(1, sent))).requests
    again = GrammarBitmask.from_row_bytes({r.request_id: r.bitmask for r in got})
    assert got[0].params.structured == StructuredOutputs(regex="ab+")
    assert torch.equal(again.mask[again.rows["y"]], mask.mask[1])
    assert torch.equal(again.mask[again.rows["x"]], mask.mask[0])
    assert GrammarBitmask.from_row_bytes({}) is None and mask.row_bytes("z") is None


def test_no_bitmask_changes_nothing():
    logits = torch.randn(3, VOCAB_SIZE)
    before = logits.clone()
    apply_bitmask(logits, ["a", "b", "c"], None)
    apply_bitmask(logits, ["a", "b", "c"], GrammarBitmask.allocate(["z"], VOCAB_SIZE))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("choice", ['say "hi"', "back\\slash", "two\nlines", "caf\u00e9 \u2603", "tab\there", ""])
def test_choices_match_exactly(choice):
    spec = StructuredOutputs(choice=(choice, "other"))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB + ["\u00e9", "\u2603", "\t", "H", "A"])).compile_grammar(
        build_grammar(spec))
    for text, ok in ((choice, True), (choice + "x", False)):
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string(text) and matcher.is_completed()
        assert accepted == ok, (text, json.dumps(text))


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 4},
                                    {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}},
                                     "required": ["a"]}])
def test_length_bounded_strings_stay_json(schema):
    """xgrammar writes these strings with a character class that admits raw control characters (its issue #800);
    ``build_grammar`` mends them: a tab or U+0016 is refused; text (non-ASCII too) is taken."""
    compiled = xgr.GrammarCompiler(_info()).compile_grammar(build_grammar(StructuredOutputs(json=json.dumps(schema))))
    wrap = (lambda s: s) if schema["type"] == "string" else (lambda s: '{"a": ' + s + "}")
    for text, ok in (('"ab"', True), ('"a\tb"', False), ('"a\x16"', False), ('"\u00e9"', True), ('"a\nb"', False)):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert (matcher.accept_string(wrap(text)) and matcher.is_completed()) == ok, text
        if ok:
            json.loads(wrap(text))
