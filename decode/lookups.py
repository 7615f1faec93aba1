"""Store lookups off the engine thread: a request's lookup starts when it arrives, the scheduler takes the answer.

Who calls it: ``ChunkLoader`` owns one (``loader.lookups``); ``StoreConnector`` calls it on the engine thread:

    lookups.ask(request_id, chunk_keys, chunk_lens)   # connector.add: queued for the lookup thread
    lookups.take(request_id)  -> tokens | None        # connector.num_loadable_tokens, each schedule until answered
    lookups.cancel(request_id)                        # connector.forget / release: aborted or done, answer or not
    lookups.wait(timeout_s)                           # LLMEngine.step with nothing running: a bounded wait for any
                                                      #   answer (no spin while a store does not answer)

The ``kv-lookup`` thread runs ``lookup(chunk_keys, chunk_lens)`` (``ChunkLoader.lookup``: the health gate, a
store error or timeout is a miss, 0 tokens, counted) one request at a time, in arrival order. A store that
does not answer holds this thread only: the engine thread keeps stepping the running requests, the request
waits in the scheduler's queue (vLLM's ``get_num_new_matched_tokens`` -> None: ask again next step).

An answer is matched to the ask that started it (a ticket per ask): a request aborted while its lookup runs
leaves nothing here, and an id added again later never takes the answer of the earlier request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class StoreLookups:
    def __init__(self, lookup: Callable[[list[str], list[int]], int]):
        self._lookup = lookup
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._answered = threading.Condition()     # guards the two dicts; notified on each answer
        self._asked: dict[str, object] = {}        # request id -> ticket of its ask, until taken or cancelled
        self._answers: dict[str, int] = {}         # request id -> store tokens, until taken
        self._thread = threading.Thread(target=self._loop, name="kv-lookup", daemon=True)
        self._thread.start()

    def ask(self, request_id: str, chunk_keys: list[str], chunk_lens: list[int]) -> None:
        ticket = object()
        with self._answered:
            self._asked[request_id] = ticket
            self._answers.pop(request_id, None)
        self._queue.put((request_id, ticket, chunk_keys, chunk_lens))

    def take(self, request_id: str) -> int | None:
        """The store tokens once answered (then forgotten here), else None."""
        with self._answered:
            if request_id not in self._answers:
                return None
            del self._asked[request_id]
            return self._answers.pop(request_id)

    def cancel(self, request_id: str) -> None:
        with self._answered:
            self._asked.pop(request_id, None)
            self._answers.pop(request_id, None)

    def wait(self, timeout_s: float) -> bool:
        """Until an ask is answered or ``timeout_s`` passed; False at once when no ask is pending."""
        with self._answered:
            if len(self._asked) == len(self._answers):
                return False
            self._answered.wait(timeout_s)
            return True

    def stop(self, timeout_s: float = 10.0) -> bool:
        """End the thread; queued asks are dropped (no store call), one in flight ends by its store's timeout."""
        with self._answered:
            self._asked.clear()
            self._answers.clear()
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __len__(self) -> int:
        """Requests known here (asked, not yet taken or cancelled): 0 when nothing leaked."""
        with self._answered:
            return len(self._asked)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            request_id, ticket, keys, lens = item
            with self._answered:
                if self._asked.get(request_id) is not ticket:
                    continue                       # cancelled before it ran: no store call
            try:
                tokens = self._lookup(keys, lens)
            except Exception:  # noqa: BLE001 - the lookup counts store errors itself; anything else is a miss too
                logger.exception("KV store lookup of %s failed; it recomputes", request_id)
                tokens = 0
            with self._answered:
                if self._asked.get(request_id) is ticket:
                    self._answers[request_id] = tokens
                    self._answered.notify_all()
