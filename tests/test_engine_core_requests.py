"""The engine-core link keeps requests apart and their errors intact (review 14).

A refused add reads as the in-process node's error (its exception's type name), and the receiver
delivers only the live add of a request id: outputs of an aborted add never reach a new add of that id
(end to end: ``test_review14_core_request_id_reuse.py``), refusals included.
"""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.core import client as core_client
from pdserve.engine.core import messages as m
from pdserve.engine.core.output_processor import OutputProcessor
from pdserve.engine.core.proc import CoreLoop
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.server.generation import _as_api_error


class _RefusingEngine:
    store = None

    def __init__(self, exc: Exception):
        self.exc = exc

    def add_request(self, *_args) -> None:
        raise self.exc


@pytest.mark.parametrize("exc", [OverflowError("int too large"), ValueError("prompt is empty")])
def test_a_refused_add_reads_as_the_in_process_error(exc):
    """The API's message names the core's exception type (``OverflowError: ...``), as in-process."""
    loop = CoreLoop(_RefusingEngine(exc), inbox=None, outbox=None)
    rejected, stop = loop._apply([m.AddRequest("r", 3, [1], SamplingParams())])
    [wire] = m.decode_core_message(m.encode(m.CoreOutputs(rejected=rejected))).rejected
    assert not stop and wire.seq == 3
    remote = core_client._rejection(wire)
    local, through = _as_api_error("r", exc), _as_api_error("r", remote)
    assert (through.status, through.message) == (local.status, local.message)


def _wire(seq: int, token: int, final: bool) -> m.CoreOutput:
    return m.CoreOutput("x", seq, [token], final, "length" if final else None, 1, 0)


def test_outputs_of_an_aborted_add_are_dropped(tiny_llama):
    """The receiver delivers only the live add's outputs of an id; a reused id gets none of its old ones."""
    from pdserve.engine.text.tokenizer import load_tokenizer

    delivered = []
    client = object.__new__(core_client.EngineCoreClient)          # no process: only the receiver's bookkeeping
    client._lock, client._outputs = threading.Lock(), OutputProcessor(load_tokenizer(tiny_llama), False)
    client._outputs.add("x", 2, [1, 2], SamplingParams(max_tokens=2))  # x was aborted (#1) and added again (#2)
    client._deliver = lambda *args: delivered.append(args)
    for seq, token, final in ((1, 10, False), (1, 11, True), (2, 20, False), (2, 21, True), (2, 22, False)):
        client._deliver_outputs(m.CoreOutputs([_wire(seq, token, final)]))
    client._deliver_outputs(m.CoreOutputs(rejected=[m.Rejected("x", 2, "ValueError", "late", True)]))
    assert [(rid, item.new_token_ids, final) for rid, item, final in delivered] == \
        [("x", [20], False), ("x", [21], True)]
