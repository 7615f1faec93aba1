"""Scheduler: chunked prefill, decode-first, preemption, aborts, stops — driven by a paged fake runner.

``PagedTokenRunner`` is a real paged cache whose "KV" is the token id itself: it writes each
computed token into its slot through the block table and samples the next token from what it
reads back through the table. So a wrong block table, a prefix hit on the wrong block, or a
block reused while still referenced shows up as a mismatch, and every finished request must
equal the reference generation computed without any scheduler.
"""

from __future__ import annotations

import random

import pytest
import xxhash

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.block_manager import BlockManager
from pdserve.engine.sched.request import Request, RequestStatus, check_stop
from pdserve.engine.sched.scheduler import Scheduler

EOS = 0
VOCAB = 16


def next_token(tokens: list[int]) -> int:
    return xxhash.xxh64_intdigest(bytes(tokens)) % VOCAB


def reference(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    req = Request("ref", list(prompt), params, eos_token_id=EOS, arrival_time=0.0)
    while True:
        req.append_output_token(next_token(req.all_token_ids))
        if check_stop(req, max_model_len) is not None:
            return req.output_token_ids


class PagedTokenRunner:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, out) -> dict[str, int]:
        bs, sampled = self.block_size, {}
        for item in out.scheduled:
            req, start = item.request, item.first_token_index
            assert start == req.num_computed_tokens
            for p in range(start, start + item.num_new_tokens):
                self.slots[req.block_ids[p // bs]][p % bs] = req.all_token_ids[p]
            if item.samples:
                end = start + item.num_new_tokens
                seen = [self.slots[req.block_ids[p // bs]][p % bs] for p in range(end)]
                assert seen == req.all_token_ids[:end], f"{req.request_id}: KV read back differs"
                sampled[req.request_id] = next_token(seen)
        return sampled


class Harness:
    def __init__(self, num_blocks=64, block_size=4, budget=8, max_num_seqs=8, max_model_len=1000,
                 prefix_caching=True):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(self.bm, budget, max_num_seqs, max_model_len)
        self.runner = PagedTokenRunner(num_blocks, block_size)
        self.finished: list[Request] = []
        self.clock = 0.0

    def add(self, rid: str, prompt, arrival: float | None = None, **params) -> Request:
        self.clock += 1.0
        params.setdefault("max_tokens", 4)
        req = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=EOS,
                      arrival_time=self.clock if arrival is None else arrival)
        self.sched.add_request(req)
        return req

    def step(self):
        out = self.sched.schedule()
        self.finished += self.sched.update_from_output(out, self.runner.execute(out))
        self.sched.check_integrity()
        return out

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        assert self.bm.num_free_blocks == self.bm.num_blocks

    def expect(self, req: Request) -> list[int]:
        return reference(req.prompt_token_ids, req.sampling_params, self.sched.max_model_len)


def chunks(out) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.first_token_index, s.num_new_tokens) for s in out.scheduled]


def test_long_prompt_is_split_by_the_token_budget():
    h = Harness(budget=8)
    a = h.add("a", range(1, 21), max_tokens=3, ignore_eos=True)
    assert chunks(h.step()) == [("a", 0, 8)] and a.output_token_ids == []
    assert chunks(h.step()) == [("a", 8, 8)]
    out = h.step()
    assert chunks(out) == [("a", 16, 4)] and out.scheduled[0].samples and out.num_batched_tokens == 4
    assert chunks(h.step()) == [("a", 20, 1)]
    h.run()
    assert a.output_token_ids == h.expect(a) and a.finish_reason == "length"


def test_decodes_go_first_then_prefill_chunks_then_waiting():
    h = Harness(budget=8)
    a = h.add("a", [1, 2, 3], ignore_eos=True, max_tokens=6)
    b = h.add("b", range(10, 30), ignore_eos=True)
    assert chunks(h.step()) == [("a", 0, 3), ("b", 0, 5)]
    c = h.add("c", [5, 5, 5], ignore_eos=True)
    assert chunks(h.step()) == [("a", 3, 1), ("b", 5, 7)]            # c waits: no budget left
    assert chunks(h.step()) == [("a", 4, 1), ("b", 12, 7)]
    assert chunks(h.step()) == [("a", 5, 1), ("b", 19, 1), ("c", 0, 3)]
    assert chunks(h.step()) == [("a", 6, 1), ("b", 20, 1), ("c", 3, 1)]
    h.run()
    for req in (a, b, c):
        assert req.output_token_ids == h.expect(req)


def test_max_num_seqs_caps_the_running_set():
    h = Harness(max_num_seqs=2, budget=100)
    reqs = [h.add(f"r{i}", [i + 1] * 3, ignore_eos=True, max_tokens=2) for i in range(3)]
    h.step()
    assert h.sched.num_running == 2 and h.sched.num_waiting == 1
    h.run()
    assert [r.output_token_ids for r in reqs] == [h.expect(r) for r in reqs]


def test_prefix_cache_hit_sets_cached_tokens_and_skips_computation():
    h = Harness(block_size=4, budget=64)
    a = h.add("a", range(1, 11), max_tokens=2, ignore_eos=True)
    h.run()
    b = h.add("b", range(1, 11), max_tokens=2, ignore_eos=True)
    assert chunks(h.step()) == [("b", 8, 2)] and b.num_cached_tokens == 8
    c = h.add("c", range(1, 9), max_tokens=2, ignore_eos=True)          # whole prompt cached: 1 block less
    assert chunks(h.step()) == [("b", 10, 1), ("c", 4, 4)] and c.num_cached_tokens == 4
    h.run()
    assert b.output_token_ids == a.output_token_ids == h.expect(a)
    assert h.bm.prefix_cache_stats.hits == 12


def test_victim_is_the_latest_arrival_even_if_already_scheduled_this_step():
    h = Harness(num_blocks=5, block_size=4, budget=6)
    b = h.add("b", [1, 2, 3], arrival=2.0, max_tokens=4, ignore_eos=True)
    a = h.add("a", range(10, 28), arrival=1.0, max_tokens=2, ignore_eos=True)
    d = h.add("d", [4, 4], arrival=3.0, max_tokens=2, ignore_eos=True)    # waits: no budget left
    assert chunks(h.step()) == [("b", 0, 3), ("a", 0, 3)]
    assert chunks(h.step()) == [("b", 3, 1), ("a", 3, 5)]
    out = h.step()            # b's decode is chosen first, then a's chunk needs 2 blocks, 1 is free
    assert out.preempted == [b] and chunks(out) == [("a", 8, 5)] and out.num_batched_tokens == 5
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == h.expect(b)[:2] and list(h.sched.waiting) == [b, d]   # b goes first
    h.run()
    assert [r.output_token_ids for r in (a, b, d)] == [h.expect(r) for r in (a, b, d)]
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)


def test_preempted_request_resumes_from_the_front_and_keeps_cached_tokens():
    h = Harness(num_blocks=6, block_size=4, budget=32)
    warm = h.add("warm", range(50, 59), max_tokens=1, ignore_eos=True)
    h.run()
    a = h.add("a", range(1, 9), max_tokens=12, ignore_eos=True)
    b = h.add("b", list(range(50, 58)) + [7], max_tokens=12, ignore_eos=True)   # hits warm's 2 blocks
    c = h.add("c", [9, 9], max_tokens=1, ignore_eos=True)
    h.step()
    assert b.num_cached_tokens == 8 and c.finish_reason == "length" and h.sched.num_running == 2
    preempted = []
    for _ in range(40):
        if not h.sched.has_unfinished():
            break
        out = h.step()
        preempted += out.preempted
        if b in out.preempted:
            assert h.sched.waiting[0] is b
    assert preempted and preempted[0] is b and a.num_preemptions == 0
    assert b.num_cached_tokens == 8                       # the first value, kept across preemption
    h.run()
    for req in (warm, a, b, c):
        assert req.output_token_ids == h.expect(req), req.request_id


def test_request_that_can_never_fit_is_finished_with_the_numbers():
    h = Harness(num_blocks=4, block_size=4, budget=32)
    big = h.add("big", range(1, 18))
    small = h.add("small", [3, 4], ignore_eos=True, max_tokens=2)
    out = h.step()
    assert out.rejected == [big] and big in h.finished and chunks(out) == [("small", 0, 2)]
    assert big.status == RequestStatus.FINISHED_ABORTED and big.finish_reason == "abort"
    assert "needs 5 KV blocks for 17 tokens" in big.stop_reason and "4 blocks of 4 tokens" in big.stop_reason
    h.run()
    assert small.output_token_ids == h.expect(small)


def test_request_that_outgrows_the_cache_ends_with_length():
    h = Harness(num_blocks=4, block_size=4, budget=32)
    r = h.add("r", range(1, 15), ignore_eos=True, max_tokens=10)
    h.run()
    assert r.status == RequestStatus.FINISHED_LENGTH and "needs 5 KV blocks for 17 tokens" in r.stop_reason
    assert r.output_token_ids == h.expect(r)[:3]


def test_abort_at_every_point_frees_everything():
    def scenario() -> tuple[Harness, list[Request]]:
        h = Harness(num_blocks=7, block_size=2, budget=5, max_num_seqs=3)
        reqs = [h.add("a", [1, 2, 3, 4, 5], max_tokens=5), h.add("b", [1, 2, 3, 4, 9], max_tokens=6),
                h.add("c", [7] * 7, max_tokens=4, ignore_eos=True), h.add("d", [1, 2], max_tokens=3)]
        return h, reqs

    h, _ = scenario()
    total_steps = 0
    while h.sched.has_unfinished():
        h.step()
        total_steps += 1
    for stop_at in range(total_steps + 1):
        for victim in range(4):
            h, reqs = scenario()
            for _ in range(stop_at):
                h.step()
            expect_live = not reqs[victim].status.is_finished
            assert (h.sched.abort_request(reqs[victim].request_id) is reqs[victim]) == expect_live
            assert h.sched.abort_request(reqs[victim].request_id) is None
            assert reqs[victim].block_ids == [] and reqs[victim].status.is_finished
            h.sched.check_integrity()
            h.run()
            for i, req in enumerate(reqs):
                if i != victim:
                    assert req.output_token_ids == h.expect(req)


def test_abort_between_schedule_and_update_is_skipped():
    h = Harness()
    a = h.add("a", [1, 2, 3], max_tokens=3, ignore_eos=True)
    out = h.sched.schedule()
    sampled = h.runner.execute(out)
    h.sched.abort_request("a")
    assert h.sched.update_from_output(out, sampled) == [] and a.output_token_ids == []
    h.sched.check_integrity()
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_finish_request_for_a_stop_string_frees_blocks():
    h = Harness()
    a = h.add("a", [1, 2, 3], max_tokens=9, ignore_eos=True)
    h.step()
    assert h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED) is a
    assert a.finish_reason == "stop" and h.bm.num_free_blocks == h.bm.num_blocks
    with pytest.raises(ValueError, match="FINISHED_"):
        h.sched.finish_request("a", RequestStatus.RUNNING)


def test_add_request_rejects_duplicates_and_overlong_prompts():
    h = Harness(max_model_len=8)
    h.add("a", [1, 2])
    with pytest.raises(ValueError, match="already scheduled"):
        h.add("a", [1, 2])
    with pytest.raises(ValueError, match="prompt has 9 tokens; --max-model-len is 8"):
        h.add("b", range(9))


def _stop(output, eos=EOS, prompt=(1, 2), max_model_len=100, extra=(), **params) -> RequestStatus | None:
    req = Request("r", list(prompt), SamplingParams(**params), eos_token_id=eos, arrival_time=0.0,
                  extra_eos_token_ids=extra)
    for tok in output:
        req.append_output_token(tok)
    status = check_stop(req, max_model_len)
    return status and (status, req.stop_reason)


def test_stop_conditions():
    stopped, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
    assert _stop([5, EOS]) == (stopped, None)
    assert _stop([5, EOS], ignore_eos=True) is None
    assert _stop([EOS], min_tokens=2) is None and _stop([EOS, EOS], min_tokens=2) == (stopped, None)
    assert _stop([5, 7], stop_token_ids=[7]) == (stopped, 7)
    assert _stop([5, 7], stop_token_ids=[7], min_tokens=3) is None
    assert _stop([5, 9], extra=(9,)) == (stopped, None) and _stop([9], extra=(9,), ignore_eos=True) is None
    assert _stop([5, 6], max_tokens=2) == (length, None)
    assert _stop([5, EOS], max_tokens=2) == (stopped, None)
    assert _stop([5, 6], max_model_len=4) == (length, None) and _stop([5], max_model_len=4) is None


def test_max_model_len_ends_generation_through_the_scheduler():
    h = Harness(max_model_len=6)
    r = h.add("r", [1, 2, 3, 4], max_tokens=10, ignore_eos=True)
    h.run()
    assert r.num_output_tokens == 2 and r.finish_reason == "length"


@pytest.mark.parametrize("seed", range(100))
def test_random_add_step_abort_sequences_keep_integrity_and_match_reference(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    h = Harness(num_blocks=rng.randint(12, 48) // bs, block_size=bs, budget=rng.randint(1, 12),
                max_num_seqs=rng.randint(1, 5), max_model_len=rng.randint(12, 40),
                prefix_caching=rng.random() < 0.8)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    reqs, cut = [], set()
    for i in range(60):
        op = rng.random()
        if op < 0.25:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
            reqs.append(h.add(f"r{i}", prompt[:12], max_tokens=rng.randint(1, 8),
                              ignore_eos=rng.random() < 0.5, min_tokens=rng.randint(0, 2)))
        elif op < 0.35 and reqs:
            victim = rng.choice(reqs)
            status = rng.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
            if h.sched.finish_request(victim.request_id, status) is not None:
                cut.add(victim.request_id)
            h.sched.check_integrity()
        else:
            h.step()
    h.run()
    assert {r.request_id for r in h.finished} | cut == {r.request_id for r in reqs}
    for req in reqs:
        want = h.expect(req)
        if req.request_id in cut or req.stop_reason and isinstance(req.stop_reason, str):
            assert req.output_token_ids == want[:req.num_output_tokens]     # cut short: a prefix
        else:
            assert req.output_token_ids == want, req.request_id


class ScriptedLoads:
    """The scheduler's side of the KV connector (``num_loadable_tokens``, ``start_load``, ``finished_loads``) with
    the store's answers set by the test: the unit layer under ``kv_connector``'s own tests."""

    def __init__(self, loadable: int):
        self.loadable, self.started, self.done = loadable, {}, {}
        self.pending: set[str] = set()      # requests whose store lookup has not answered (-> None)

    def num_loadable_tokens(self, req, local_hit: int) -> int | None:
        return None if req.request_id in self.pending else self.loadable

    def start_load(self, req, start: int, num_tokens: int) -> None:
        self.started[req.request_id] = (start, num_tokens, list(req.block_ids))

    def finished_loads(self) -> dict[str, int]:
        done, self.done = self.done, {}
        return done


def test_an_aborted_load_keeps_its_blocks_until_the_loader_reports_then_frees_them():
    """Mutation caught (issue 43; before, only end-to-end tests noticed): ``_finish_loads`` skipping ``free`` for a
    request aborted while loading -- its blocks leaked for good. Freeing them at the abort instead would let the
    loader write into blocks another request owns: they must stay taken until the load reports back."""
    h = Harness(num_blocks=16, block_size=4)
    loads = ScriptedLoads(loadable=12)
    h.sched.connector = loads
    a = h.add("a", range(1, 17), max_tokens=4, ignore_eos=True)
    h.step()
    assert a.status == RequestStatus.WAITING_FOR_KV and loads.started["a"][:2] == (0, 12)
    held = h.bm.num_blocks - h.bm.num_free_blocks
    assert held > 0 and h.sched.abort_request("a") is a
    h.step()                                                   # the loader is still writing: nothing freed yet
    assert h.bm.num_blocks - h.bm.num_free_blocks == held and h.sched.has_unfinished()
    loads.done = {"a": 12}
    h.step()
    assert not h.sched.has_unfinished() and h.bm.num_free_blocks == h.bm.num_blocks
    h.sched.check_integrity()


def test_a_layerwise_load_runs_at_once_and_a_failed_one_rewinds_to_its_start():
    """--kv-load-layerwise: the request is scheduled in the step that starts its load, its loaded range counted as
    computed; a failed load (``rewound``) takes that step back -- no token, computed tokens back to the load's start,
    same blocks, nothing registered in the prefix cache -- and the next step recomputes from there.
    Mutation caught: ``update_from_output`` ignoring ``rewound`` -> a token sampled from a partial cache is kept."""
    h = Harness(num_blocks=16, block_size=4, budget=8)
    loads = ScriptedLoads(loadable=12)
    loads.load_layerwise = True
    h.sched.connector = loads
    a = h.add("a", range(1, 17), max_tokens=3, ignore_eos=True)
    out = h.sched.schedule()
    assert chunks(out) == [("a", 12, 4)] and a.status == RequestStatus.RUNNING and not h.sched.loading
    assert loads.started["a"][:2] == (0, 12) and len(a.block_ids) == 4 and out.scheduled[0].samples
    blocks = list(a.block_ids)
    # the load failed under it: the runner's token came from a partial cache (this harness's runner would refuse)
    h.sched.update_from_output(out, {"a": 99}, rewound={"a": 0})
    h.sched.check_integrity()
    assert a.num_computed_tokens == 0 and a.output_token_ids == [] and a.block_ids == blocks
    assert h.bm.get_computed_blocks(a) == ([], 0)                  # nothing of the dropped step is cached
    assert chunks(h.step()) == [("a", 0, 8)]                       # recomputed from the load's start
    assert chunks(h.step()) == [("a", 8, 8)] and a.output_token_ids == h.expect(a)[:1]
    h.run()
    assert a.output_token_ids == h.expect(a)


def test_a_request_whose_lookup_is_pending_waits_in_place_and_holds_up_no_one():
    """vLLM's ``get_num_new_matched_tokens`` -> None: the request at the queue's head is skipped (no blocks, no
    budget), the running request decodes and the one behind it is admitted; it keeps its place ahead of later
    arrivals and is admitted in the step its answer came. Mutation caught: a ``break`` on None (the queue behind
    it waits for the store), or dropping it from the queue (it never runs)."""
    h = Harness(num_blocks=32, block_size=4, budget=16)
    loads = ScriptedLoads(loadable=0)
    h.sched.connector = loads
    a = h.add("a", range(1, 6), max_tokens=8, ignore_eos=True)
    assert chunks(h.step()) == [("a", 0, 5)]
    loads.pending.add("b")
    b = h.add("b", range(10, 16), max_tokens=3, ignore_eos=True)
    c = h.add("c", range(20, 23), max_tokens=3, ignore_eos=True)
    assert chunks(h.step()) == [("a", 5, 1), ("c", 0, 3)]
    assert b.status == RequestStatus.WAITING and not b.block_ids and list(h.sched.waiting) == [b]
    d = h.add("d", range(30, 33), max_tokens=3, ignore_eos=True)
    assert chunks(h.step()) == [("a", 6, 1), ("c", 3, 1), ("d", 0, 3)] and list(h.sched.waiting) == [b]
    loads.pending.clear()
    e = h.add("e", range(40, 43), max_tokens=3, ignore_eos=True)
    assert chunks(h.step()) == [("a", 7, 1), ("c", 4, 1), ("d", 3, 1), ("b", 0, 6), ("e", 0, 3)]
    h.run()
    for r in (a, b, c, d, e):
        assert r.output_token_ids == h.expect(r), r.request_id
