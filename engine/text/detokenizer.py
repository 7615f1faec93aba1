"""Incremental detokenization and stop strings, one ``IncrementalDetokenizer`` per request.

Called by the engine after every step with the request's new token ids. Decoding only a short
window keeps each step O(new tokens): text is emitted once the window no longer ends in a
partial UTF-8 character (``\ufffd``), the way vLLM and TGI detokenize.

    tokens:  [last prompt tokens) [output tokens ...................................]
             ...  [prefix_offset ........ read_offset) [new tokens]
    text already emitted = decode(window up to read_offset); new text = the rest

``for_request`` primes the window with the prompt's last tokens (vLLM's
``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``): SentencePiece / Metaspace decoders drop the
leading space of a decoded sequence, so without that context the first output token would
lose its space (" Paris" -> "Paris") and a stop string starting with a space could never match.

Stop strings follow vLLM: searched only once more than ``min_tokens`` tokens were produced, and
only where they end in new text; the text of the first ``min_tokens`` tokens never completes one.

``RequestText`` adds the finish rules on top, one token at a time; it is the one detokenization code of
both node kinds: ``OutputAssembler`` runs it in the in-process engine, ``core.output_processor`` in the
API process of ``--engine-core-process`` (the core then sends token ids only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

PROMPT_CONTEXT = 5          # prompt tokens that prefix the first window ...
PROMPT_TAIL = PROMPT_CONTEXT + 2   # ... taken from this many, in case some are special (skipped)


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)   # prompt tail, then output tokens
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_by: str | None = None
    sent: int = 0                      # characters of ``text`` already returned
    num_context: int = 0               # leading ``token_ids`` that are prompt, not output

    @classmethod
    def for_request(cls, tokenizer, prompt_token_ids: list[int], params) -> "IncrementalDetokenizer":
        """A detokenizer whose first window starts in the prompt's last tokens (see module doc)."""
        tail = list(prompt_token_ids[-PROMPT_TAIL:])
        return cls(tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens, tail,
                   prefix_offset=max(len(tail) - PROMPT_CONTEXT, 0), read_offset=len(tail), num_context=len(tail))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_context

    @property
    def _hold(self) -> int:
        return 0 if self.stopped_by is not None or not self.stop else max(len(s) for s in self.stop) - 1

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they completed (may be '' while a character is partial)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.token_ids))
        if not full.endswith("\ufffd") and len(full) > len(prefix):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self._apply_stop(full[len(prefix):])
        return self._release(len(self.text) - self._hold)

    def flush(self) -> str:
        """Everything still held back once the request has finished (a partial character included)."""
        if self.stopped_by is None and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.prefix_offset, self.read_offset)
            full = self._decode(self.prefix_offset, len(self.token_ids))
            self.prefix_offset = self.read_offset = len(self.token_ids)
            self._apply_stop(full[len(prefix):])
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return decoder(self.tokenizer)(self.token_ids[start:stop])

    def _apply_stop(self, delta: str) -> None:
        """Append delta to text; if a stop string ends in it, cut the text there and remember it."""
        before = len(self.text)
        self.text += delta
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return
        hit = _first_stop(self.text, self.stop, before)
        if hit is None:
            return
        index, stop_str = hit
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self.text = self.text[:end]
        self.stopped_by = stop_str


class RequestText:
    """One request's text, token by token, with vLLM's finish rules:

    - the text of an eos / stop token id is left out unless ``include_stop_str_in_output``;
    - a stop string ends the request with "stop" and itself as ``stop_reason``, even on the token that
      reached the length limit; one completed only by the final flush of an eos / stop-id-ended
      request cuts the text there, but that request stays stopped by its token.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params):
        self.detok = IncrementalDetokenizer.for_request(tokenizer, prompt_token_ids, params)
        self.include_stop_str_in_output = params.include_stop_str_in_output

    def add_token(self, token_id: int, finish_reason: str | None) -> tuple[str, str | None]:
        """``finish_reason``: how the engine ended the request on this token ("stop" for eos or a stop
        token id, "length", "abort"), None while it goes on. -> (the token's text, the stop string that
        ends the request here or None)."""
        d = self.detok
        stop_token = finish_reason == "stop" and not self.include_stop_str_in_output
        text = "" if stop_token else d.add_tokens([token_id])
        if finish_reason is not None or d.stopped_by is not None:
            text += d.flush()                                   # may complete a stop string too
        return text, d.stopped_by if finish_reason != "stop" else None


def _first_stop(text: str, stops: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string that ends after ``new_from`` (it may start before)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


@functools.lru_cache(maxsize=16)
def decoder(tokenizer):
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, by the Rust tokenizer directly when that
    is what transformers' wrapper would return (no clean-up of spaces): 5x less time per decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)
