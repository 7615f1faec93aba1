"""Output parsers: a choice's generated text in, plain content and OpenAI tool-call deltas out.

One parser per choice, fed every new piece of text (``feed``) and told when the text ends (``finish``); a whole
answer is the same parser fed once (``parse_whole``), so a streamed answer reassembles to the non-streamed one.

    NamedParser        tool_choice names a function: all the text is its arguments
    RequiredParser     tool_choice "required": ``[{"name": ..., "parameters": {...}}, ...]`` (the constraint's shape)
    HermesParser       --tool-call-parser hermes: content, and calls as ``<tool_call>{"name", "arguments"}</tool_call>``
    Llama3JsonParser   --tool-call-parser llama3_json: an answer that starts with ``{`` (or ``<|python_tag|>``) is
                       calls ``{"name", "parameters"}`` separated by ``;``; any other answer is content

Text that does not read as a call stays content (a ``<tool_call>`` block whose object has no name, an answer that
is not JSON), as vLLM does. With ``parallel_tool_calls`` false a parser keeps the first call only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pdserve.engine.server.tools.scanner import CallScanner

_WS = " \t\n\r"


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
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolOutputParser:
    forced = False                  # the output is calls only (content is null)

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls = 0              # calls started (named)
        self._scanner: CallScanner | None = None
        self._raw = ""              # text the current scanner consumed (content again if it is no call)

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        raise NotImplementedError

    def _scan(self, text: str, out: ToolDelta) -> str:
        """Feed the current call; its news into ``out``; returns the text after the call's object."""
        rest = self._scanner.feed(text)
        self._raw += text[:len(text) - len(rest)]
        name, fragment = self._scanner.take()
        if name is not None:
            self.calls += 1
            if self._keeps():
                out.calls.append(CallDelta(self.calls - 1, new_call_id(), name, fragment))
        elif fragment and self._keeps():
            out.calls.append(CallDelta(self.calls - 1, arguments=fragment))
        return rest

    def _keeps(self) -> bool:
        return self.parallel or self.calls <= 1

    def _start_call(self) -> None:
        self._scanner, self._raw = CallScanner(), ""

    def _unnamed(self) -> bool:
        """The current scanner ended (or the text did) without a name: its text is content."""
        return self._scanner is not None and self._scanner.name is None


class NamedParser(ToolOutputParser):
    forced = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ToolDelta:
        if not self.calls:
            self.calls = 1
            return ToolDelta(calls=[CallDelta(0, new_call_id(), self.name, text)])
        return ToolDelta(calls=[CallDelta(0, arguments=text)] if text else [])

    def finish(self) -> ToolDelta:
        return self.feed("") if not self.calls else ToolDelta()


class RequiredParser(ToolOutputParser):
    """A JSON array of ``{"name", "parameters"}`` objects; what is not (a cut-off answer's tail) is content."""
    forced = True

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.state = "start"        # start | item | scan | sep | end | junk

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            if self.state == "scan":
                text = self._scan(text, out)
                if self._scanner.done:
                    self.state = "sep"
                continue
            if self.state == "junk":
                out.content += text
                break
            ch, text = text[0], text[1:]
            if ch not in _WS:
                self._step(ch, out)
        return out

    def _step(self, ch: str, out: ToolDelta) -> None:
        if (self.state, ch) in (("start", "["), ("sep", ",")):
            self.state = "item"
        elif self.state == "item" and ch == "{":
            self._start_call()
            self._scan(ch, out)
            self.state = "scan"
        elif (self.state, ch) == ("sep", "]"):
            self.state = "end"
        else:
            self.state, out.content = "junk", out.content + ch

    def finish(self) -> ToolDelta:
        return ToolDelta()


class HermesParser(ToolOutputParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.state = "content"      # content | scan | close
        self._held = ""             # content that may be the start of a tag; the end tag read so far

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            if self.state == "content":
                text = self._content(text, out)
            elif self.state == "scan":
                text = self._scan(text, out)
                if self._scanner.done:
                    self._after_call(out)
            else:
                text = self._close(text, out)
        return out

    def _content(self, text: str, out: ToolDelta) -> str:
        text, self._held = self._held + text, ""
        at = text.find(self.START)
        if at >= 0:
            out.content += text[:at]
            self._start_call()
            self.state = "scan"
            return text[at + len(self.START):]
        keep = _partial_suffix(text, self.START)
        out.content += text[:len(text) - keep]
        self._held = text[len(text) - keep:]
        return ""

    def _after_call(self, out: ToolDelta) -> None:
        if self._unnamed():
            out.content += self.START + self._raw
            self.state = "content"
        else:
            self.state = "close"
        self._scanner = None if self._unnamed() else self._scanner

    def _close(self, text: str, out: ToolDelta) -> str:
        """Whitespace, then the end tag; anything else goes back to content."""
        while text:
            if not self._held and text[0] in _WS:
                text = text[1:]
                continue
            self._held += text[0]
            text = text[1:]
            if self._held == self.END:
                self.state, self._held = "content", ""
                return text
            if not self.END.startswith(self._held):
                self.state = "content"
                held, self._held = self._held, ""
                return held + text
        return ""

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.state == "content":
            out.content, self._held = self._held, ""
        elif self.state == "scan" and self._unnamed():
            out.content = self.START + self._raw
        return out


class Llama3JsonParser(ToolOutputParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.state = "sniff"        # sniff | item | scan | sep | content
        self._held = ""

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            if self.state == "content":
                out.content += text
                break
            if self.state == "sniff":
                text = self._sniff(text, out)
            elif self.state == "scan":
                text = self._scan(text, out)
                if self._scanner.done:
                    self._after_call(out)
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
            out.content += held
        return ""

    def _between(self, text: str, out: ToolDelta) -> str:
        stripped = text.lstrip(_WS)
        if not stripped:
            return ""
        if self.state == "item" and stripped[0] == "{":
            self._start_call()
            self.state = "scan"
            return stripped
        if self.state == "sep" and stripped[0] == ";":
            self.state = "item"
            return stripped[1:]
        self.state = "content"
        return stripped

    def _after_call(self, out: ToolDelta) -> None:
        if self._unnamed():
            out.content += self._raw
            self.state = "content"
        else:
            self.state = "sep"

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.state == "sniff":
            out.content, self._held = self._held, ""
        elif self.state == "scan" and self._unnamed():
            out.content = self._raw
        return out


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
    if not content.strip() and (calls or parser.forced):
        return WholeAnswer(None, calls)                   # calls only: OpenAI's null content
    return WholeAnswer(content, calls)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be arriving)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
