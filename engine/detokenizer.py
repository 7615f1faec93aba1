"""Incremental detokenization and stop strings, one ``IncrementalDetokenizer`` per request.

Called by the engine after every step with the request's new token ids. Decoding only a short
window keeps each step O(new tokens): text is emitted once the window no longer ends in a
partial UTF-8 character (``\ufffd``), the way vLLM and TGI detokenize.

    tokens:  ...  [prefix_offset ........ read_offset) [new tokens]
    text already emitted = decode(window up to read_offset); new text = the rest
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_by: str | None = None
    sent: int = 0                      # characters of ``text`` already returned

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
        return self.tokenizer.decode(self.token_ids[start:stop], skip_special_tokens=True)

    def _apply_stop(self, delta: str) -> None:
        """Append delta to text; if a stop string appears, cut the text there and remember it."""
        if not self.stop:
            self.text += delta
            return
        before = len(self.text)
        combined = self.text + delta
        search_from = max(0, before - max(len(s) for s in self.stop) + 1)
        hit = _first_stop(combined, self.stop, search_from)
        if hit is None:
            self.text = combined
            return
        index, stop_str = hit
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self.text = combined[:end]
        self.stopped_by = stop_str


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
