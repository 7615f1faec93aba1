"""Send a list of requests on ``vllm bench serve``'s schedule and collect their ``RequestOutput``s.

Called by ``serve.run_bench`` (and so by ``sweep``) with one shared ``aiohttp.ClientSession``
(``make_client``):

    await run_warmups(http, specs, traffic)                    # not measured
    outputs, duration_s = await run_requests(http, specs, TrafficConfig(request_rate=4.0, ...))

Order: ``num_warmups`` copies of the first request (``run_warmups``) -> the clock starts -> for each
round (datasets_rounds; one round otherwise): requests are released at gamma-distributed arrival
times (shape = burstiness, mean 1/rate, rescaled so the last one is released at n/rate; all at
once when the rate is inf), each waits for a ``--max-concurrency`` slot, then streams -> the clock
stops when the last request of the last round has ended. A multi-round request with a ``session``
(``--multi-round-history generated``) is sent with its session's last prompt + the answer streamed back +
its ``turn``: the conversation a chat client carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import RequestSpec, send
from pdserve.bench.metrics import RequestOutput


@dataclass(frozen=True)
class TrafficConfig:
    request_rate: float = math.inf       # requests/s; inf: all at t=0
    burstiness: float = 1.0              # gamma shape; 1.0 = Poisson arrivals
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    disable_tqdm: bool = False

    def __post_init__(self):
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate {self.request_rate} must be > 0 (inf: all at once)")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness {self.burstiness} must be > 0 (1.0: Poisson)")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"--max-concurrency {self.max_concurrency} must be > 0")


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Release time (s after the start) of each of ``n`` requests; the last one lands at n/rate."""
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()


async def run_requests(http: aiohttp.ClientSession, specs: list[RequestSpec],
                       traffic: TrafficConfig) -> tuple[list[RequestOutput], float]:
    """The measured run (warmups are ``run_warmups``, called first by the caller)."""
    limit = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    rng = np.random.default_rng(traffic.seed)
    bar = tqdm(total=len(specs), disable=traffic.disable_tqdm, desc="requests")
    outputs: list[RequestOutput] = []
    history: dict[int, tuple[tuple[str, str], ...]] = {}     # session -> its turns, the last answer included
    start = time.perf_counter()
    for round_specs in _rounds(specs):
        round_specs = [_continued(s, history) for s in round_specs]
        round_outputs = await _run_round(http, round_specs, traffic, rng, limit, bar)
        for spec, out in zip(round_specs, round_outputs):
            if spec.session >= 0:
                history[spec.session] = (spec.messages or (("user", spec.prompt),)) + \
                    (("assistant", out.generated_text),)
        outputs += round_outputs
    duration = time.perf_counter() - start
    bar.close()
    return outputs, duration


def _continued(spec: RequestSpec, history: dict[int, tuple[tuple[str, str], ...]]) -> RequestSpec:
    """A later round of a generated-history session: the session's turns, the answer the server gave (empty
    when that request failed), then this round's question -- as messages for openai-chat, as one text (their
    concatenation) for completions. Its token count is the usage chunk's (``prompt_len`` keeps the synthetic
    history's count for a server that sends no usage)."""
    if spec.session < 0 or spec.session not in history:
        return spec
    turns = history[spec.session] + (("user", spec.turn),)
    return dataclasses.replace(spec, prompt="".join(text for _, text in turns), messages=turns)


def _rounds(specs: list[RequestSpec]) -> list[list[RequestSpec]]:
    return [[s for s in specs if s.round == r] for r in sorted({s.round for s in specs})]


async def _run_round(http, specs, traffic: TrafficConfig, rng, limit, bar) -> list[RequestOutput]:
    times = arrival_times(len(specs), traffic.request_rate, traffic.burstiness, rng)
    t0 = time.perf_counter()
    tasks = []
    for spec, at in zip(specs, times):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_limited(http, spec, limit, bar)))
    return list(await asyncio.gather(*tasks))


async def _limited(http, spec: RequestSpec, limit, bar) -> RequestOutput:
    arrived = time.perf_counter()
    async with limit or contextlib.nullcontext():
        out = await send(http, spec)
    out.client_queue_time = out.start_time - arrived
    bar.update(1)
    return out


async def run_warmups(http: aiohttp.ClientSession, specs: list[RequestSpec], traffic: TrafficConfig) -> None:
    """``num_warmups`` copies of the first request, under the same concurrency limit (vLLM's warmup)."""
    n = traffic.num_warmups
    if not n or not specs:
        return
    limit = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    bar = tqdm(total=n, disable=traffic.disable_tqdm, desc="warmup")
    outs = await asyncio.gather(*[_limited(http, specs[0], limit, bar) for _ in range(n)])
    bar.close()
    failed = [o.error for o in outs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} warmup requests failed; first error: {failed[0]}")


def make_client(max_concurrency: int | None, timeout_s: float = 6 * 3600) -> aiohttp.ClientSession:
    """One pooled session for the whole run: at most --max-concurrency connections (none: no cap),
    ``timeout_s`` for a whole request, 30 s to open a socket. Proxy variables are honoured, as
    httpx and ``vllm bench serve`` do. An SSE line may be up to 512 KiB (aiohttp's default
    read_bufsize x 2); a longer one fails its request. Call it inside the run's event loop."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True)
