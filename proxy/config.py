"""The proxy's one frozen config, built by ``cli.config_from_args`` and read by every proxy module."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request_limits import RequestLimits
from pdserve.engine.server.tools.config import ToolConfig

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")

STORE_SCHEMES = ("tcp://", "redis://", "rediss://", "unix://", "redis+cluster://")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    model: str                                   # tokenizer dir, the same the nodes load
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None         # None: ask the nodes' /v1/models
    api_keys: tuple[str, ...] = ()               # --api-key K1 K2 ...: any of them is accepted; none: no auth
    node_api_key: str | None = field(default=None, repr=False)   # sent to the nodes (their --api-key)
    cache_salt_from_api_key: bool = False        # each key a tenant: its own cache_salt (proxy.tenants)
    cache_salt_secret_file: str | None = None    # the tenant salts' HMAC key; None: random per process
    expose_kv_accounting: bool = False           # usage.kv_transfer in answers (pdserve serve: on)
    trust_traceparent: bool = True               # a client's W3C traceparent parents the proxy's span (vLLM's way);
                                                 # False: every request starts its own trace, sampled here only
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_loaded"
    health_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    max_attempts: int = 3                        # per phase, each on another node
    prefix_chunk_tokens: int = 256               # chunk size of the routing keys (the store's default)
    max_node_connections: int = 1024             # the pool of node calls (health probes have their own)
    timeout_keep_alive_s: float = 75.0           # an idle client connection is closed after this (see cli)
    kv_store: str | None = None                  # tcp://HOST:PORT of the store daemon, or the nodes' shared Redis
                                                 # (redis://, redis+cluster://): lookups for routing
    kv_redis_prefix: str = "pdkv:"               # with a Redis kv_store: the nodes' --kv-redis-prefix
    kv_auth_token: str = field(default="", repr=False)   # the cluster token: store requests, KV events' MAC
    local_prefill_threshold: int = 0             # uncached prompt tokens below this: the decode node prefills
    skip_prefill_on_store_hit: bool = True       # with kv_store: a full store hit goes to the decode node only
    limits: RequestLimits = field(default_factory=RequestLimits)   # body size, tokenization (as on the nodes)
    tools: ToolConfig = field(default_factory=ToolConfig)           # tool_choice "auto" (as on the nodes)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError(f"need >= 1 prefill and >= 1 decode URL, got {len(self.prefill_urls)} prefill "
                             f"and {len(self.decode_urls)} decode (--prefill URL... --decode URL...)")
        for name in (self.prefill_policy, self.decode_policy):
            if name not in POLICIES:
                raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
        _positive("--health-interval", self.health_interval_s)
        _positive("--request-timeout", self.request_timeout_s)
        _positive("--max-attempts", self.max_attempts)
        _positive("--prefix-chunk-tokens", self.prefix_chunk_tokens)
        _positive("--max-node-connections", self.max_node_connections)
        _positive("--timeout-keep-alive", self.timeout_keep_alive_s)
        if self.local_prefill_threshold < 0:
            raise ValueError(f"--local-prefill-threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.kv_store is not None and not self.kv_store.startswith(STORE_SCHEMES):
            raise ValueError(f"--kv-store {self.kv_store!r} must be tcp://HOST:PORT (a `pdserve kvstore` daemon) or "
                             "the nodes' Redis (redis://, rediss://, redis+cluster://)")
        for flag, urls in (("--prefill", self.prefill_urls), ("--decode", self.decode_urls)):
            _check_urls(flag, urls)
        _check_tenancy(self)

    @property
    def probe_timeout_s(self) -> float:
        """A /health probe that takes longer than this counts as failed."""
        return max(0.5, min(2.0, self.health_interval_s))


def _positive(flag: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{flag} must be > 0, got {value}")


def _check_tenancy(config: ProxyConfig) -> None:
    if not all(config.api_keys):
        raise ValueError("--api-key got an empty key; every key must be non-empty")
    if config.cache_salt_from_api_key and not config.api_keys:
        raise ValueError("--cache-salt-from-api-key needs --api-key KEY [KEY ...] (one key per tenant)")
    if config.cache_salt_secret_file is not None and not config.cache_salt_from_api_key:
        raise ValueError("--cache-salt-secret-file is only used with --cache-salt-from-api-key")


def _check_urls(flag: str, urls: tuple[str, ...]) -> None:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag} URL {url!r} must start with http:// or https://")
        if urls.count(url) > 1:
            raise ValueError(f"{flag} lists {url} {urls.count(url)} times; list each node once")
