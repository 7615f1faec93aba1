"""``CallScanner``: one tool call written as a JSON object -- ``{"name": "f", "arguments": {...}}`` (``parameters``
in llama3_json and in a "required" answer) -- read a piece of text at a time, as the model writes it.

    scanner = CallScanner()
    rest = scanner.feed(text)        # consumes up to the object's closing brace; ``rest`` is what follows it
    name, fragment = scanner.take()  # the name once it is complete (once), the argument text not yet taken
    scanner.done, scanner.failed     # the object closed; it was not a call (not an object, no usable name)
    scanner.raw                      # every character it consumed (the caller's content if it is no call)

The arguments come out as the model wrote them (the raw JSON text of the value, so a client concatenating the
fragments gets exactly the object), held back until the name is known -- OpenAI clients expect the name first. An
``arguments`` written as a JSON string (some models quote it) comes out decoded, at once when it ends; a call
without arguments has ``{}``. A string that decodes to a lone UTF-16 surrogate (``"\\ud800"``) is no name (the call
fails) and no decoded argument text (the raw text stays): it could not be written out as UTF-8.

A lexer, not a validator: strings, escapes and nesting are tracked so that braces inside strings do not count;
whether the arguments are valid JSON is for the constraint (forced calls) or the client (``auto``). Linear in the
text: the inside of a string is taken a run at a time (up to the next quote or backslash), every buffer is a list.
"""

from __future__ import annotations

import json
import re

from pdserve.engine.server.text import text_problem

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\]')


class CallScanner:
    def __init__(self) -> None:
        self.state = "start"        # start | key | keystr | colon | value | invalue | after | done
        self.failed = False
        self._key = ""
        self._key_parts: list[str] = []
        self._target: str | None = None     # where the value being read goes: "name", "args" or nowhere
        self._stack: list[str] = []         # brackets open inside the value being read
        self._in_string = self._escape = False
        self._name_parts: list[str] = []
        self.name: str | None = None
        self._named = False                 # the name was handed out by ``take``
        self._args: list[str] = []          # raw argument text
        self._pending: list[str] = []       # raw argument text not handed out yet
        self._args_done = self._quoted = self._handed = False
        self._raw: list[str] = []

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def raw(self) -> str:
        return "".join(self._raw)

    def feed(self, text: str) -> str:
        i, n = 0, len(text)
        while i < n:
            if self.state == "done":
                self._raw.append(text[:i])
                return text[i:]
            if self._in_run():
                stop = _STRING_STOP.search(text, i)
                end = stop.start() if stop else n
                if end > i:
                    self._run(text[i:end])
                    i = end
                    continue
            self._char(text[i])
            i += 1
        self._raw.append(text)
        return ""

    def take(self) -> tuple[str | None, str]:
        """(the name if it became known since the last call, argument text not handed out yet)."""
        if self.name is None:
            return None, ""
        name = None if self._named else self.name
        self._named = True
        if self._quoted:                    # a quoted arguments string comes out decoded, once complete
            if not (self._args_done or self.done) or self._handed:
                return name, ""
            self._handed = True
            return name, self.final_arguments
        fragment = "".join(self._pending)
        self._pending.clear()
        if self.done and not self._args and not self._handed:
            self._handed, fragment = True, "{}"
        return name, fragment

    @property
    def final_arguments(self) -> str:
        raw = "".join(self._args)
        if not raw:
            return "{}" if self.done else ""
        if self._quoted and self._args_done:
            decoded = _decode_string(raw[1:-1])
            return decoded if decoded is not None else raw
        return raw

    def _in_run(self) -> bool:
        """Inside a key or a string value, past any escape: the characters up to the next quote or backslash
        can be taken at once."""
        return not self._escape and (self.state == "keystr" or (self.state == "invalue" and self._in_string))

    def _run(self, chunk: str) -> None:
        if self.state == "keystr":
            self._key_parts.append(chunk)
        else:
            self._take(chunk)

    def _fail(self) -> None:
        self.failed, self.state = True, "done"

    def _char(self, ch: str) -> None:
        state = self.state
        if state == "invalue":
            self._value_char(ch)
        elif state == "keystr":
            self._key_char(ch)
        elif ch in _WS:
            return
        elif state == "start":
            self._expect(ch, "{", "key")
        elif state == "key":
            self._key_start(ch)
        elif state == "colon":
            self._expect(ch, ":", "value")
        elif state == "value":
            self._value_start(ch)
        elif state == "after":
            self._after(ch)

    def _expect(self, ch: str, wanted: str, then: str) -> None:
        if ch == wanted:
            self.state = then
        else:
            self._fail()

    def _key_start(self, ch: str) -> None:
        if ch == '"':
            self.state, self._key_parts = "keystr", []
        elif ch == "}":
            self._close()
        else:
            self._fail()

    def _key_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._key = _decode_string("".join(self._key_parts)) or ""
            self.state = "colon"
            return
        self._key_parts.append(ch)

    def _value_start(self, ch: str) -> None:
        self._target = "name" if self._key == "name" else "args" if self._key in ARGUMENT_KEYS else None
        if self._target == "name" and ch != '"':
            self._fail()
            return
        if self._target == "args":
            self._quoted = ch == '"'
        self.state, self._stack, self._in_string, self._escape = "invalue", [], False, False
        self._value_char(ch)

    def _value_char(self, ch: str) -> None:
        if self._in_string:
            self._take(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if not self._stack:
                    self._end_value()
        elif ch == '"':
            self._in_string = True
            self._take(ch)
        elif ch in "{[":
            self._stack.append(ch)
            self._take(ch)
        elif ch in "}]" and self._stack:
            self._stack.pop()
            self._take(ch)
            if not self._stack:
                self._end_value()
        elif not self._stack and (ch in ",}" or ch in _WS):    # the end of a number, true, false or null
            self._end_value()
            self._char(ch)
        else:
            self._take(ch)

    def _take(self, text: str) -> None:
        if self._target == "name":
            self._name_parts.append(text)
        elif self._target == "args":
            self._args.append(text)
            self._pending.append(text)

    def _end_value(self) -> None:
        if self._target == "name":
            self.name = _decode_string("".join(self._name_parts)[1:-1])
            if self.name is None:
                self._fail()
                return
        elif self._target == "args":
            self._args_done = True
        self.state = "after"

    def _after(self, ch: str) -> None:
        if ch == ",":
            self.state = "key"
        elif ch == "}":
            self._close()
        else:
            self._fail()

    def _close(self) -> None:
        self.state = "done"
        if self.name is None:
            self.failed = True


def _decode_string(raw: str) -> str | None:
    """A JSON string's content (without its quotes) decoded; None if it is not valid, or not Unicode text."""
    try:
        text = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return None if text_problem(text) else text
