"""``AttentionMetadata.layer_hooks``: the model calls ``before(i)`` / ``after(i)`` around each of its layers, in
order, on the plain and the rows-only paths, and the hooks see the cache as a layerwise load or publish would:
before layer i its K/V for the step is not written yet, after it it is."""

from __future__ import annotations

import torch

from test_models import BLOCK_SIZE, BLOCK_TABLE, PROMPT_LEN, make_hf_model

from pdserve.engine.kv.layer_hooks import HookChain
from pdserve.engine.models.loader import load_model
from pdserve.engine.models.llama import LogitRows
from pdserve.kernels import AttentionMetadata


class Recorder:
    def __init__(self, caches, slots, name="r"):
        self.caches, self.slots, self.name, self.calls = caches, slots, name, []

    def _written(self, layer: int) -> bool:
        k = next(iter(self.caches[layer].values())).flatten(0, 1)     # [slots, ...]
        return bool(k[self.slots].abs().sum() > 0)

    def before(self, layer: int) -> None:
        self.calls.append((self.name, "before", layer, self._written(layer)))

    def after(self, layer: int) -> None:
        self.calls.append((self.name, "after", layer, self._written(layer)))


def _step(tmp_path, keep_rows: bool):
    make_hf_model("llama", tmp_path)
    model, config = load_model(tmp_path)
    caches = config.kv_layout(num_layers=model.num_layers).allocate(len(BLOCK_TABLE) + 2, BLOCK_SIZE)
    n = PROMPT_LEN
    meta = AttentionMetadata.build([n], [n], [BLOCK_TABLE], BLOCK_SIZE)
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    return model, caches, meta, ids


def test_hooks_run_around_each_layer_in_order(tmp_path):
    model, caches, meta, ids = _step(tmp_path, False)
    a, b = Recorder(caches, meta.slot_mapping.long(), "a"), Recorder(caches, meta.slot_mapping.long(), "b")
    meta.layer_hooks = HookChain.of(None, a, b)
    with torch.inference_mode():
        model(ids, torch.arange(len(ids)), caches, meta)
    want = []
    for i in range(model.num_layers):
        want += [("a", "before", i, False), ("b", "before", i, False), ("a", "after", i, True), ("b", "after", i, True)]
    merged = [c for pair in zip(a.calls, b.calls) for c in pair]
    assert sorted(merged, key=lambda c: (c[2], c[1] != "before")) == sorted(want, key=lambda c: (c[2], c[1] != "before"))
    assert [c[1:3] for c in a.calls] == [(s, i) for i in range(model.num_layers) for s in ("before", "after")]


def test_hooks_run_on_the_rows_only_last_layer(tmp_path):
    model, caches, meta, ids = _step(tmp_path, True)
    rec = Recorder(caches, meta.slot_mapping.long())
    meta.layer_hooks = rec
    rows = torch.tensor([len(ids) - 1])
    with torch.inference_mode():
        model(ids, torch.arange(len(ids)), caches, meta, logit_rows=LogitRows(rows, meta.for_rows(rows)))
    assert [c[1:] for c in rec.calls] == [(s, i, s == "after") for i in range(model.num_layers)
                                          for s in ("before", "after")]


def test_no_hooks_no_calls():
    assert HookChain.of(None, None) is None
