"""Per-layer hooks of one eager step: where the KV connector meets the model's layer loop.

The runner puts a ``LayerHooks`` on the step's ``AttentionMetadata.layer_hooks`` (None on most steps, and
always None in a captured CUDA graph); the model (``LlamaForCausalLM.forward`` and its subclasses) calls

    hooks.before(i)     ahead of its i-th layer (local index on a pipeline stage): a layerwise load waits
                        here until layer i's loaded KV is in the cache
    hooks.after(i)      once layer i has run: the step's new K/V of layer i is in the cache, so a
                        layerwise publish may take it while later layers compute

on the engine thread, in layer order, once per layer per forward.
"""

from __future__ import annotations

from typing import Protocol


class LayerHooks(Protocol):
    def before(self, layer: int) -> None: ...

    def after(self, layer: int) -> None: ...


class HookChain:
    """Several hooks in one (a step may both load and publish layerwise); ``of`` drops the Nones."""

    def __init__(self, hooks: list):
        self.hooks = hooks

    @staticmethod
    def of(*hooks) -> "LayerHooks | None":
        present = [h for h in hooks if h is not None]
        if not present:
            return None
        return present[0] if len(present) == 1 else HookChain(present)

    def before(self, layer: int) -> None:
        for hook in self.hooks:
            hook.before(layer)

    def after(self, layer: int) -> None:
        for hook in self.hooks:
            hook.after(layer)
