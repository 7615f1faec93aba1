"""``EngineCoreClient``: what ``AsyncEngine`` uses of ``LLMEngine``, served by an engine-core process.

    client = EngineCoreClient(config, deliver=..., die=...)   # starts the core, waits for Ready
    client.check_prompt(n, max_tokens); client.check_transfer(params)   # answered here, no round trip
    client.add_request(id, ids, params, transfer)             # sent at once (any thread)
    client.abort_request(id)
    deliver(id, RequestOutput | exception, final)             # from the receiver thread, per output (with text)
    die(message)                                              # once: the core sent Fatal or exited
    client.stats()                                            # the core's last report (/metrics)
    client.shutdown()                                         # Shutdown, wait, kill what did not exit

The two sockets are ``channel.ApiChannel``'s (bound in a 0700 dir before the core starts, answered only
when the core proved StartCore's token, removed once it has). One receiver thread reads the core's
messages; between messages (every POLL_S) it checks the process with ``waitpid``, so a killed core is
reported within POLL_S, and the time since the core's last message: the core sends one at least every
HEARTBEAT_S (from a thread of its own, also during a long step), so silence past ``--rank-timeout``
means a stopped or wedged process: the client SIGKILLs it and reports it like an exit. The core's pid is ``client.pid``.

Each add gets its own ``seq`` (``messages``); an output is delivered only while its request id still maps
to that seq, so the last outputs of an aborted request never reach a new request that reuses its id.
The core sends token ids; the receiver thread turns them into text (``OutputProcessor``) and sends
``StopRequests`` for the requests a stop string ended.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from pdserve.engine.core import messages as m
from pdserve.engine.core.channel import ApiChannel
from pdserve.engine.core.llm_engine import check_logit_bias_ids, check_prompt_fits, check_prompt_ids
from pdserve.engine.core.output_processor import OutputProcessor
from pdserve.engine.kv.kv_transfer import KVTransferParams, check_transfer
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.outputs import EngineDeadError, EngineStats, RequestOutput
from pdserve.engine.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
POLL_S = 0.05                      # the receiver checks the core's pid this often while no message comes
_POLL_MS = int(POLL_S * 1000)


class EngineCoreError(RuntimeError):
    """The engine-core process failed to start; the message is its own report."""


class EngineCoreClient:
    def __init__(self, config, deliver, die, start_timeout: float = 600.0):
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.model_config = ModelConfig.from_dir(config.model, dtype=config.dtype)   # vocab size for the edge
        self._deliver, self._die = deliver, die
        self._fatal: str | None = None
        self._stopping = self._closed = False
        self._lock = threading.Lock()                          # the send socket, _closed and _outputs
        self._next_seq = itertools.count(1)
        self._channel = ApiChannel()          # bound in a 0700 dir before the core exists, removed once it connected
        try:
            self.proc = _spawn()
        except BaseException:
            self._channel.close()
            raise
        try:
            m.write_start(self.proc.stdin, self._channel.start_message(config))     # the token: stdin only
            ready = self._wait_ready(start_timeout)
        except BaseException:                                  # a failed start, or a signal (NodeStopped)
            self._stop_process(graceful=False)
            self._channel.close()
            raise
        self.pid, self.max_model_len, self._store, self._stats = ready.pid, ready.max_model_len, ready.store, \
            ready.stats
        self.kv_events_endpoint, self.kv_replay_endpoint = ready.kv_events, ready.kv_replay
        self._outputs = OutputProcessor(self.tokenizer, wait_for_core=ready.store is not None)
        logger.info("engine core ready in process %d (%d KV blocks)", ready.pid, ready.num_blocks)
        self._receiver = threading.Thread(target=self._receive_loop, name="pdserve-core-receiver", daemon=True)
        self._receiver.start()

    # -- LLMEngine's methods ------------------------------------------------------------------

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The in-process engine's checks and messages (``LLMEngine.check_prompt``)."""
        check_prompt_fits(num_prompt_tokens, max_tokens, self.max_model_len)

    def store_info(self) -> m.StoreInfo | None:
        """The store figures the core reported when ready (``LLMEngine.store_info``)."""
        return self._store

    def check_transfer(self, kv_transfer_params: dict | None) -> None:
        """``LLMEngine.check_transfer`` against the store figures the core reported when ready."""
        s = self._store
        check_transfer(kv_transfer_params, self.model_config.vocab_size, None if s is None else (
            lambda t: t.check_compatible(fingerprint=s.fingerprint, block_size=s.block_size,
                                         chunk_tokens=s.chunk_tokens, kv_layout=s.kv_layout)))

    def check_token_ids(self, prompt_token_ids) -> None:
        """``LLMEngine.check_token_ids``: here, before the core sees an id it could not decode."""
        check_prompt_ids(prompt_token_ids, self.model_config.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                    kv_transfer_params: dict | None = None, cache_salt: str | None = None) -> None:
        if self._fatal is not None:
            raise EngineDeadError(self._fatal)
        self.check_token_ids(prompt_token_ids)
        check_logit_bias_ids(params, self.model_config.vocab_size)
        ids = [int(t) for t in prompt_token_ids]              # numpy ints included: the wire takes int
        transfer = KVTransferParams.from_json_obj(kv_transfer_params) if kv_transfer_params else None
        stop = self._outputs.first_token_stop(ids, params, transfer)
        with self._lock:
            seq = next(self._next_seq)
            add = m.AddRequest(request_id, seq, ids, params, transfer, stop, cache_salt)
            payload = m.encode(add)                           # fails registering nothing
            self._outputs.add(request_id, seq, ids, params)
            if not self._closed:
                self._channel.send(payload)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._outputs.remove(request_id)                   # what the core still sends for it is dropped
            self._send_locked(m.AbortRequests([request_id]))

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._fatal is None and self.proc.poll() is None

    def shutdown(self) -> None:
        """Shutdown to the core (it stops its KV publisher, store and ranks in order), wait, kill. Idempotent."""
        if self._closed:
            return
        self._stopping = True
        self._stop_process(graceful=True)
        self._receiver.join(timeout=5.0)
        with self._lock:
            self._closed = True
        self._channel.close()

    # -- the receiver thread ------------------------------------------------------------------

    def _receive_loop(self) -> None:
        timeout = self.config.parallel.rank_timeout
        heard = time.monotonic()
        try:
            while not self._stopping and self._fatal is None:
                msg = self._channel.receive(_POLL_MS)          # None: nothing came, or a frame was dropped
                if msg is not None:
                    self._handle(msg)
                    heard = time.monotonic()
                    continue
                code = self.proc.poll()
                if code is not None and not self._stopping:
                    self._fail(f"the engine-core process (pid {self.proc.pid}) {_describe(code)}")
                elif time.monotonic() - heard > timeout and not self._stopping:
                    self._kill_hung(time.monotonic() - heard, timeout)
        except Exception as exc:  # noqa: BLE001 - a broken link must end the node, never hang its clients
            if not self._stopping:
                logger.exception("the engine-core link failed")
                self._fail(f"the engine-core link failed: {type(exc).__name__}: {exc}")

    def _handle(self, msg) -> None:
        if isinstance(msg, m.Heartbeat):
            return None
        if isinstance(msg, m.Fatal):
            return self._fail(msg.message)
        if not isinstance(msg, m.CoreOutputs):
            return logger.warning("ignoring an unexpected %s from the engine core", type(msg).__name__)
        with self._lock:                  # an abort (or a new add of the same id) cannot slip in between
            self._deliver_outputs(msg)
        if msg.stats is not None:
            self._stats = msg.stats

    def _deliver_outputs(self, msg: m.CoreOutputs) -> None:
        """Deliver what is for a live add (text added), ask the core to stop what a stop string ended."""
        for r in msg.rejected:
            if self._outputs.is_current(r.request_id, r.seq):
                self._outputs.remove(r.request_id)
                self._deliver(r.request_id, _rejection(r), True)
        stops, failed = [], []
        for wire in msg.outputs:
            try:
                out, stop = self._outputs.process(wire)
            except Exception as exc:  # noqa: BLE001 - one request's failure is that request's (as in-process)
                out, stop = self._failed_output(wire, exc), None
                failed.append(wire.request_id)
            if stop is not None:
                stops.append((wire.request_id, stop))
            if out is not None:
                self._deliver(out.request_id, out, out.finished)
        if stops:
            ids, strings = zip(*stops)
            self._send_locked(m.StopRequests(list(ids), list(strings)))
        if failed:
            self._send_locked(m.AbortRequests(failed))

    def _failed_output(self, wire: m.CoreOutput, exc: Exception) -> RequestOutput:
        """Detokenizing or stop strings raised for this request: it ends with an error, as the in-process
        node's ``OutputAssembler.fail`` ends it (finish_reason "abort"); the core is told to abort it."""
        message = f"output processing failed: {type(exc).__name__}: {exc}"
        logger.warning("request %s failed: %s", wire.request_id, message)
        self._outputs.remove(wire.request_id)
        return RequestOutput(wire.request_id, [], "", True, "abort", wire.num_prompt_tokens,
                             wire.num_cached_tokens, error=message)

    def _kill_hung(self, silent_s: float, timeout: float) -> None:
        """No message for longer than ``timeout``: the process is stopped or wedged. Kill it, report it."""
        self.proc.kill()                                       # SIGKILL by pid: a stopped process dies too
        self._fail(f"the engine-core process (pid {self.proc.pid}) sent nothing for {silent_s:.1f}s "
                   f"(--rank-timeout {timeout:g}); killed it")

    def _fail(self, message: str) -> None:
        if self._fatal is None:
            self._fatal = message
            logger.error("%s; failing every request, the node stops", message)
            self._die(message)

    # -- the process ----------------------------------------------------------------------------

    def _post(self, message) -> None:
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message) -> None:
        if not self._closed:
            self._channel.send(m.encode(message))

    def _wait_ready(self, timeout: float) -> m.Ready:
        """Ready from the core, once both its connections proved the token (``channel.ApiChannel``)."""
        deadline, ready = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            msg = self._channel.poll_start(_POLL_MS)
            ready = msg if isinstance(msg, m.Ready) else ready
            if ready is not None and self._channel.ready:
                return ready
            if isinstance(msg, m.Fatal):
                raise EngineCoreError(msg.message)
            if msg is None and self.proc.poll() is not None:
                raise EngineCoreError(f"the engine-core process {_describe(self.proc.returncode)} while starting; "
                                      "see its log above")
        raise EngineCoreError(f"the engine core did not start within {timeout:.0f}s")

    def _stop_process(self, graceful: bool) -> None:
        """Shutdown and wait (graceful), then close the lifeline (the core leaves at once), then SIGKILL."""
        if graceful and self.proc.poll() is None:
            self._post(m.Shutdown("node shutdown"))
            _wait(self.proc, self.config.parallel.rank_timeout + 15)
        self.proc.stdin.close()
        if not _wait(self.proc, 5.0):
            logger.error("the engine-core process (pid %d) did not exit; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait()


def _spawn() -> subprocess.Popen:
    """The core in its own session (Ctrl-C reaches only the API process, which stops it in order). It dies
    with the thread that starts it (PR_SET_PDEATHSIG): start it from the thread that lives as long as the node."""
    cmd = [sys.executable, "-m", "pdserve.engine.core.proc", "--parent-pid", str(os.getpid())]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PDSERVE_LOG_LEVEL=_log_level())
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, start_new_session=True)


def _log_level() -> str:
    """This process's level for pdserve's loggers (``pdserve --log-level``), as PDSERVE_LOG_LEVEL accepts it:
    the core and its tp x pp ranks log like the in-process engine would."""
    level = logging.getLogger("pdserve").getEffectiveLevel()
    for name in ("DEBUG", "INFO", "WARNING"):
        if level <= getattr(logging, name):
            return name
    return "ERROR"


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _rejection(r: m.Rejected) -> Exception:
    """The exception ``add_request`` raised in the core, as the in-process node would report it: a ValueError
    (HTTP 400), or an error of the same type name (``type(exc).__name__`` in the API's message)."""
    if r.invalid:
        return ValueError(r.message)
    return type(r.error_type, (RuntimeError,), {"__module__": __name__})(r.message)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
