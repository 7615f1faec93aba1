"""``RequestLimits``: what one request may cost before it is refused -- the node's and the proxy's config
(``pdserve node`` / ``pdserve proxy`` flags), read by ``engine.server.limits`` (body size and nesting)
and ``engine.server.prompt_work`` (tokenization). Kept free of server imports: every CLI start reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 8 << 20      # --max-request-bytes: a request body, checked before parsing
    max_json_depth: int = 32              # nesting of a JSON body ([ and {)
    tokenize_timeout_s: float = 10.0      # --tokenize-timeout: tokenizing / chat templating one request
    tokenize_workers: int = 4             # threads that tokenize, per process

    def __post_init__(self) -> None:
        for flag, value in (("--max-request-bytes", self.max_request_bytes), ("max_json_depth", self.max_json_depth),
                            ("--tokenize-timeout", self.tokenize_timeout_s),
                            ("tokenize_workers", self.tokenize_workers)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")


def add_limit_flags(parser) -> None:
    """The flags of ``RequestLimits`` (``pdserve node`` and ``pdserve proxy``)."""
    parser.add_argument("--max-request-bytes", type=int, default=RequestLimits.max_request_bytes,
                        help="largest request body accepted (413 beyond it), checked before parsing")
    parser.add_argument("--tokenize-timeout", type=float, default=RequestLimits.tokenize_timeout_s,
                        help="seconds tokenizing and chat-templating one request may take (503 beyond it)")


def limits_from_args(args) -> RequestLimits:
    return RequestLimits(max_request_bytes=args.max_request_bytes, tokenize_timeout_s=args.tokenize_timeout)
