"""Chat templates rendered in a bounded Jinja sandbox: the template comes with the model, the messages
from any client, and neither may hold a worker thread or memory without limit.

Called by ``tokenizer.apply_chat_template`` (node and proxy alike), usually in a tokenize worker thread:

    text = render_chat(tokenizer, messages, add_generation_prompt, TemplateLimits(deadline_s=10, max_chars=N))

The environment is transformers' (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, its ``tojson`` / ``raise_exception`` / ``strftime_now`` / ``dict`` / ``namespace``), so the
text is the one ``tokenizer.apply_chat_template(..., tokenize=False)`` renders. On top of the sandbox:

- a deadline, checked at every attribute and item lookup, call, filter, arithmetic operator and output chunk:
  a template looping over the messages (or over ``range``) stops when it passes it;
- ``range`` at most ``MAX_RANGE`` items;
- a size limit on every string or list a call, filter, lookup or operator produces (``'x' * 10**9``, a
  namespace string that doubles in a loop) and on the rendered output.

A template that breaks a limit raises ``TemplateLimitError`` (a ``ValueError``: the request is refused).
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RANGE = 16_384          # items of one range() in a template
MAX_POWER_BITS = 4_096      # bits of an integer ``a ** b`` may produce


class TemplateLimitError(ValueError):
    """The chat template ran past its deadline or produced more than its size limit."""


@dataclass(frozen=True)
class TemplateLimits:
    deadline_s: float = 10.0         # wall-clock seconds one render may take
    max_chars: int = 4 << 20         # characters of the output and of any one string or list made on the way


class _Budget:
    """One render's deadline and size limit; every hook of the environment checks it."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.deadline_s

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {self.limits.deadline_s:g} s "
                                     "(--tokenize-timeout)")

    def sized(self, value, what: str):
        self.tick()
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.limits.max_chars:
            raise TemplateLimitError(f"the chat template made a {what} of {len(value)} items; the limit is "
                                     f"{self.limits.max_chars}")
        return value


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox plus the checks of the running render's ``_Budget`` (one compiled template
    serves every thread; each render sets its budget in a thread-local)."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def getattr(self, obj, attribute):
        return _current().sized(super().getattr(obj, attribute), "value")

    def getitem(self, obj, argument):
        return _current().sized(super().getitem(obj, argument), "value")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        _current().tick()
        return _current().sized(super().call(__context, __obj, *args, **kwargs), "call result")

    def call_binop(self, context, operator, left, right):
        budget = _current()
        budget.tick()
        if operator == "**" and _power_too_big(left, right):
            raise TemplateLimitError(f"the chat template computes {_short(left)} ** {_short(right)}; too large")
        if operator == "*" and _repeat_too_big(left, right, budget.limits.max_chars):
            raise TemplateLimitError(f"the chat template repeats a value more than {budget.limits.max_chars} "
                                     "items long")
        return budget.sized(super().call_binop(context, operator, left, right), "value")


_local = threading.local()          # .budget: the render running in this thread


def _current() -> _Budget:
    return getattr(_local, "budget", None) or _UNLIMITED


def _short(value) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= 40 else text[:40] + "..."


def _power_too_big(left, right) -> bool:
    if not (isinstance(left, int) and isinstance(right, int)) or right < 0 or abs(left) < 2:
        return False
    return right * math.log2(abs(left)) > MAX_POWER_BITS


def _repeat_too_big(left, right, limit: int) -> bool:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            return len(seq) * times > limit
    return False


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` tag (marks assistant text for training masks): its body, as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _bounded_range(*args):
    _current().tick()
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise TemplateLimitError(f"the chat template asks for range({', '.join(map(str, args))}) of "
                                 f"{len(rng)} items; the limit is {MAX_RANGE}")
    return rng


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _guarded_filter(fn):
    @functools.wraps(fn)             # keeps jinja's pass_context / pass_environment marks
    def guarded(*args, **kwargs):
        return _current().sized(fn(*args, **kwargs), "filter result")
    return guarded


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(fn) for name, fn in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace, range=_bounded_range)
    return env.from_string(source)


_UNLIMITED = _Budget(TemplateLimits(deadline_s=math.inf, max_chars=1 << 62))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                limits: TemplateLimits = TemplateLimits(), tools: list[dict] | None = None) -> str:
    """The prompt text of ``messages`` (and ``tools``, OpenAI's shape, as transformers passes them) under the
    tokenizer's chat template, within ``limits``."""
    source = tokenizer.get_chat_template()
    context = {**_special_tokens(tokenizer), "messages": messages, "tools": tools, "documents": None,
               "add_generation_prompt": add_generation_prompt}
    budget = _Budget(limits)
    previous, _local.budget = getattr(_local, "budget", None), budget
    try:
        out, size = [], 0
        for chunk in _compile(source).generate(**context):
            size += len(chunk)
            if size > limits.max_chars:
                raise TemplateLimitError(f"the chat template rendered more than {limits.max_chars} characters")
            budget.tick()
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise TemplateLimitError("the chat template recursed too deeply") from None
    finally:
        _local.budget = previous


def _special_tokens(tokenizer) -> dict:
    """``bos_token``, ``eos_token``, ... as plain strings (what transformers passes to the template)."""
    out = {}
    for name, value in tokenizer.special_tokens_map.items():
        out[name] = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value)
    return out
