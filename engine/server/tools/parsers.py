"""Output parsers: a choice's generated text in, plain content and OpenAI tool-call deltas out.

One parser per choice, fed every new piece of text (``feed``) and told when the text ends (``finish``); a whole
answer is the same parser fed once (``parse_whole``), so a streamed answer reassembles to the non-streamed one --
content included: it is exactly what the deltas carried (null when that is nothing and the answer is calls).

    NamedParser        tool_choice names a function: all the text is its arguments
    RequiredParser     tool_choice "required": ``[{"name": ..., "parameters": {...}}, ...]`` (the constraint's shape)
    HermesParser       --tool-call-parser hermes: content, and calls as ``<tool_call>{"name", "arguments"}</tool_call>``
    Llama3JsonParser   --tool-call-parser llama3_json: an answer that starts with ``{`` (or ``<|python_tag|>``) is
                       calls ``{"name", "parameters"}`` separated by ``;``; any other answer is content

Text that does not read as a call to one of the request's tools stays content (a ``<tool_call>`` block whose
object has no name or another name, a JSON answer that is not a call), as vLLM does. Whitespace is held until real
content follows it, and dropped at the end of an answer that made calls (what Qwen writes between two calls).
With ``parallel_tool_calls`` false a parser keeps the first call only. ``complete``: every call the answer started
was closed (a stop string or ``max_tokens`` can cut one; then ``finish_reason`` is not "tool_calls").
Each parser reads its text once, a run at a time: linear in the answer's length.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

from pdserve.engine.server.tools.scanner import CallScanner

_WS = " \t\n\r"
_NOT_WS = re.compile(r"[^ \t\n\r]")
_ALNUM = string.ascii_letters + string.digits


@dataclass
class CallDelta:
    index: int                      # the call's index in the answer
    id: str | None = None           # the first delta of a call carries its id and name
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class WholeAnswer:
    content: str | None
    calls: list[CallDelta]          # one per call: id, name and the whole arguments


def new_call_id() -> str:
    """``call_`` and 24 hex digits (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def short_call_id() -> str:
    """9 letters and digits: what Mistral's chat templates demand of an earlier call's id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def call_id_factory(chat_template: str | None):
    """Mistral-style ids when the model's template refuses others (it checks for length 9), else OpenAI's."""
    return short_call_id if chat_template and "length 9" in chat_template else new_call_id


class ToolOutputParser:
    forced = False                  # the output is calls only (content is null)

    def __init__(self, names: frozenset[str] = frozenset(), parallel: bool = True, ids=new_call_id) -> None:
        self.names, self.parallel, self._ids = names, parallel, ids
        self.calls = 0              # calls started (named)
        self._scanner: CallScanner | None = None
        self._blank: list[str] = []  # whitespace-only content not sent yet

    @property
    def called(self) -> bool:
        return self.calls > 0

    @property
    def complete(self) -> bool:
        """No call is half written (a text that is no call drops its scanner)."""
        return self._scanner is None or self._scanner.done

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._end(out)
        if not self.calls:
            out.content += "".join(self._blank)
        self._blank.clear()
        return out

    def _end(self, out: ToolDelta) -> None:
        """What the parser still holds when the text ends."""

    def _content(self, out: ToolDelta, text: str) -> None:
        """Content, its trailing whitespace held (sent before the next real content; dropped at the end of an
        answer that made calls): a character-level rule, so any cut of the text sends the same content."""
        body = text.rstrip(_WS)
        if body:
            out.content += "".join(self._blank) + body
            self._blank.clear()
        if len(body) < len(text):
            self._blank.append(text[len(body):])

    def _scan(self, text: str, out: ToolDelta) -> tuple[str, bool]:
        """Feed the current call; its news into ``out``. -> (the text after the call's object, whether the
        object is no call to one of the tools: then the caller makes ``self._scanner.raw`` content)."""
        scanner = self._scanner
        rest = scanner.feed(text)
        name, fragment = scanner.take()
        if name is not None and self.names and name not in self.names:
            return rest, True
        if name is not None:
            self.calls += 1
            if self._keeps():
                out.calls.append(CallDelta(self.calls - 1, self._ids(), name, fragment))
        elif fragment and self._keeps():
            out.calls.append(CallDelta(self.calls - 1, arguments=fragment))
        return rest, scanner.failed and scanner.name is None

    def _keeps(self) -> bool:
        return self.parallel or self.calls <= 1


class NamedParser(ToolOutputParser):
    forced = True

    def __init__(self, name: str, ids=new_call_id) -> None:
        super().__init__(ids=ids)
        self.name = name
        self._arguments: list[str] = []

    @property
    def complete(self) -> bool:
        try:
            json.loads("".join(self._arguments))
        except ValueError:
            return False
        return True

    def feed(self, text: str) -> ToolDelta:
        self._arguments.append(text)
        if not self.calls:
            self.calls = 1
            return ToolDelta(calls=[CallDelta(0, self._ids(), self.name, text)])
        return ToolDelta(calls=[CallDelta(0, arguments=text)] if text else [])

    def finish(self) -> ToolDelta:
        return self.feed("") if not self.calls else ToolDelta()


class RequiredParser(ToolOutputParser):
    """A JSON array of ``{"name", "parameters"}`` objects; what is not (a cut-off answer's tail) is content."""
    forced = True

    def __init__(self, names: frozenset[str] = frozenset(), parallel: bool = True, ids=new_call_id) -> None:
        super().__init__(names, parallel, ids)
        self.state = "start"        # start | item | scan | sep | end | junk

    @property
    def complete(self) -> bool:
        return self.state == "end"

    def feed(self, text: str) -> ToolDelta:
        out, i = ToolDelta(), 0
        while i < len(text):
            if self.state == "scan":
                text, not_a_call = self._scan(text[i:], out)
                i = 0
                if not_a_call:
                    self.state = "junk"
                    self._content(out, self._scanner.raw)
                elif self._scanner.done:
                    self.state = "sep"
                continue
            if self.state == "junk":
                self._content(out, text[i:])
                break
            if self.state == "end":
                break
            found = _NOT_WS.search(text, i)
            if found is None:
                break
            i = found.start()
            if self._step(text[i], out):
                continue                    # a call starts at i: the scanner reads it from there
            i += 1
        return out

    def _step(self, ch: str, out: ToolDelta) -> bool:
        if (self.state, ch) in (("start", "["), ("sep", ",")):
            self.state = "item"
        elif self.state == "item" and ch == "{":
            self._scanner, self.state = CallScanner(), "scan"
            return True
        elif (self.state, ch) == ("sep", "]"):
            self.state = "end"
        else:
            self.state = "junk"
            self._content(out, ch)
        return False


class HermesParser(ToolOutputParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str] = frozenset(), parallel: bool = True, ids=new_call_id) -> None:
        super().__init__(names, parallel, ids)
        self.state = "content"      # content | scan | close
        self._held = ""             # content that may be the start of a tag; the end tag read so far

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            if self.state == "content":
                text = self._read_content(text, out)
            elif self.state == "scan":
                text, not_a_call = self._scan(text, out)
                if not_a_call:
                    self._content(out, self.START + self._scanner.raw)
                    self.state, self._scanner = "content", None
                elif self._scanner.done:
                    self.state = "close"
            else:
                text = self._close(text, out)
        return out

    def _read_content(self, text: str, out: ToolDelta) -> str:
        text, self._held = self._held + text, ""
        at = text.find(self.START)
        if at >= 0:
            self._content(out, text[:at])
            self._scanner, self.state = CallScanner(), "scan"
            return text[at + len(self.START):]
        keep = _partial_suffix(text, self.START)
        self._content(out, text[:len(text) - keep])
        self._held = text[len(text) - keep:]
        return ""

    def _close(self, text: str, out: ToolDelta) -> str:
        """Whitespace, then the end tag; anything else goes back to content."""
        if not self._held:
            found = _NOT_WS.search(text)
            if found is None:
                return ""
            text = text[found.start():]
        take = min(len(text), len(self.END) - len(self._held))
        self._held += text[:take]
        if self._held == self.END:
            self.state, self._held = "content", ""
            return text[take:]
        if self.END.startswith(self._held):
            return text[take:]
        self.state, held, self._held = "content", self._held, ""
        return held + text[take:]

    def _end(self, out: ToolDelta) -> None:
        if self.state == "content":
            self._content(out, self._held)
            self._held = ""
        elif self.state == "scan" and self._scanner.name is None:
            self._content(out, self.START + self._scanner.raw)


class Llama3JsonParser(ToolOutputParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str] = frozenset(), parallel: bool = True, ids=new_call_id) -> None:
        super().__init__(names, parallel, ids)
        self.state = "sniff"        # sniff | item | scan | sep | content
        self._held = ""

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            if self.state == "content":
                self._content(out, text)
                break
            if self.state == "sniff":
                text = self._sniff(text, out)
            elif self.state == "scan":
                text, not_a_call = self._scan(text, out)
                if not_a_call:
                    self._content(out, self._scanner.raw)
                    self.state, self._scanner = "content", None
                elif self._scanner.done:
                    self.state = "sep"
            else:
                text = self._between(text, out)
        return out

    def _sniff(self, text: str, out: ToolDelta) -> str:
        self._held += text
        lead = self._held.lstrip(_WS)
        if lead.startswith(self.PYTHON_TAG):
            self.state, self._held = "item", ""
            return lead[len(self.PYTHON_TAG):]
        if lead.startswith("{"):
            self.state, self._held = "item", ""
            return lead
        if lead and not self.PYTHON_TAG.startswith(lead):
            self.state, held, self._held = "content", self._held, ""
            self._content(out, held)
        return ""

    def _between(self, text: str, out: ToolDelta) -> str:
        found = _NOT_WS.search(text)
        if found is None:
            return ""
        stripped = text[found.start():]
        if self.state == "item" and stripped[0] == "{":
            self._scanner, self.state = CallScanner(), "scan"
            return stripped
        if self.state == "sep" and stripped[0] == ";":
            self.state = "item"
            return stripped[1:]
        self.state = "content"
        return stripped

    def _end(self, out: ToolDelta) -> None:
        if self.state == "sniff":
            self._content(out, self._held)
            self._held = ""
        elif self.state == "scan" and self._scanner.name is None:
            self._content(out, self._scanner.raw)


def parse_whole(parser: ToolOutputParser, text: str) -> WholeAnswer:
    """A finished answer: its content (None when it is calls only) and its calls, whole."""
    content, calls = "", []
    for delta in (parser.feed(text), parser.finish()):
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                calls.append(CallDelta(call.index, call.id, call.name, call.arguments))
            else:
                calls[-1].arguments += call.arguments
    return WholeAnswer(None if not content and (calls or parser.forced) else content, calls)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be arriving)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
