"""``CallScanner``: one tool call written as a JSON object -- ``{"name": "f", "arguments": {...}}`` (``parameters``
in llama3_json and in a "required" answer) -- read a piece of text at a time, as the model writes it.

    scanner = CallScanner()
    rest = scanner.feed(text)        # consumes up to the object's closing brace; ``rest`` is what follows it
    name, fragment = scanner.take()  # the name once it is complete (once), the argument text not yet taken
    scanner.done, scanner.failed     # the object closed; it was not a call (not an object, or no name)

The arguments come out as the model wrote them (the raw JSON text of the value, so a client concatenating the
fragments gets exactly the object), held back until the name is known -- OpenAI clients expect the name first. An
``arguments`` written as a JSON string (some models quote it) comes out decoded, at once when it ends; a call
without arguments has ``{}``. A lexer, not a validator: the structure (strings, escapes, nesting) is tracked so
that braces inside strings do not count; whether the arguments are valid JSON is for the constraint (forced
calls) or the client (``auto``).
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\n\r"


class CallScanner:
    def __init__(self) -> None:
        self.state = "start"        # start | key | keystr | colon | value | invalue | after | done
        self.failed = False
        self._key = self._key_raw = ""
        self._target: str | None = None     # where the value being read goes: "name", "args" or nowhere
        self._stack: list[str] = []         # brackets open inside the value being read
        self._in_string = self._escape = False
        self._name_raw = ""
        self.name: str | None = None
        self._named = False                 # the name was handed out by ``take``
        self.arguments = ""                 # raw argument text so far
        self._args_done = False
        self._given = 0                     # characters of ``arguments`` handed out

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, text: str) -> str:
        for i, ch in enumerate(text):
            if self.state == "done":
                return text[i:]
            self._char(ch)
        return ""

    def take(self) -> tuple[str | None, str]:
        """(the name if it became known since the last call, argument text not handed out yet)."""
        if self.name is None:
            return None, ""
        name = None if self._named else self.name
        self._named = True
        if self.arguments.startswith('"') and not self._args_done:
            return name, ""                 # a quoted arguments string comes out decoded, once complete
        text = self.final_arguments if self._args_done or self.done else self.arguments
        fragment, self._given = text[self._given:], len(text)
        return name, fragment

    @property
    def final_arguments(self) -> str:
        if not self.arguments:
            return "{}" if self.done else ""
        if self.arguments.startswith('"') and self._args_done:
            try:
                decoded = json.loads(self.arguments)
                return decoded if isinstance(decoded, str) else self.arguments
            except ValueError:
                return self.arguments
        return self.arguments

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
            self.state, self._key_raw = "keystr", ""
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
            self._key = _decode_string(self._key_raw)
            self.state = "colon"
            return
        self._key_raw += ch

    def _value_start(self, ch: str) -> None:
        self._target = "name" if self._key == "name" else "args" if self._key in ARGUMENT_KEYS else None
        if self._target == "name" and ch != '"':
            self._fail()
            return
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

    def _take(self, ch: str) -> None:
        if self._target == "name":
            self._name_raw += ch
        elif self._target == "args":
            self.arguments += ch

    def _end_value(self) -> None:
        if self._target == "name":
            self.name = _decode_string(self._name_raw[1:-1])
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


def _decode_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw
