"""Compile ``StructuredOutputs`` against the model's vocabulary off the engine loop, once per constraint.

Owned by the engine core's ``StructuredOutputManager`` (``manager.py``):

    compiler = GrammarCompiler(lambda: tokenizer_info(model_dir, vocab_size, eos_ids))
    future = compiler.submit(spec)         # a Future[xgrammar.CompiledGrammar]; never blocks the caller
    compiler.shutdown()

Compiles run on a small thread pool. Futures are cached by ``spec.key`` (an LRU of ``cache_size`` entries):
a constraint already compiled, or compiling for another request, is not compiled again. A failed compile is
dropped from the cache (its requests fail; the next request with it tries again).

The vocabulary (``xgrammar.TokenizerInfo``) is built in the first compile, on the pool's thread: the
engine-core process loads no tokenizer at start-up, so a node that never sees a structured request never pays
for it. ``before_compile``, when set, runs first in every compile: a test hook (hold a compile to show that a
request waiting for its grammar holds nobody else back).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.engine.structured.grammar import build_grammar
from pdserve.engine.structured.spec import StructuredOutputs

DEFAULT_CACHE_SIZE = 128       # compiled grammars kept (each holds a mask cache of a few KiB to a few MiB)
DEFAULT_WORKERS = 2


def tokenizer_info(model_dir: str, vocab_size: int, stop_token_ids, tokenizer=None):
    """The model's vocabulary as xgrammar sees it: the tokenizer's tokens, padded to the logits' width
    (``vocab_size``), ending at ``stop_token_ids`` (the engine's eos ids). Loads the tokenizer if not given."""
    import xgrammar as xgr

    from pdserve.engine.text.tokenizer import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarCompiler:
    def __init__(self, make_tokenizer_info: Callable[[], object], max_workers: int = DEFAULT_WORKERS,
                 cache_size: int = DEFAULT_CACHE_SIZE):
        self._make_info = make_tokenizer_info
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()            # the cache (the engine thread takes it: held briefly)
        self._build_lock = threading.Lock()      # building the vocabulary, once (a pool thread; ~0.5 s)
        self._cache: OrderedDict[str, Future] = OrderedDict()   # spec.key -> its compile, done or running
        self._xgr_compiler = None
        self.cache_size = cache_size
        self.num_compiles = 0                   # compiles started (cache misses); read by tests and logs
        self.before_compile: Callable[[StructuredOutputs], None] | None = None

    def submit(self, spec: StructuredOutputs) -> Future:
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.num_compiles += 1
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            self._evict()
        future.add_done_callback(lambda f: self._drop_if_failed(key, f))
        return future

    def _evict(self) -> None:
        """Drop the least recently used finished compiles beyond ``cache_size`` (running ones stay)."""
        excess = len(self._cache) - self.cache_size
        for key in [k for k, f in self._cache.items() if f.done()][:max(0, excess)]:
            del self._cache[key]

    def _drop_if_failed(self, key: str, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, spec: StructuredOutputs):
        if self.before_compile is not None:
            self.before_compile(spec)
        grammar = build_grammar(spec)
        return self._compiler().compile_grammar(grammar)

    def _compiler(self):
        with self._build_lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                self._xgr_compiler = xgr.GrammarCompiler(self._make_info(), max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
