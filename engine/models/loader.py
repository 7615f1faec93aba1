"""Load a local HF checkpoint into our model code: ``model, config = load_model(model_dir, dtype)``.

Called by the engine at start-up (and by each worker rank later). Steps:

    ModelConfig.from_dir(dir, dtype)          config.json + generation_config.json
    model_class(arch)(config, layer range)    parameters allocated empty, in ``config.dtype``
    model.load_weights(WeightSource(dir))     each layer reads its share via get / get_slice
    eval mode, requires_grad off

``WeightSource`` reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``
through ``safetensors.safe_open`` (memory-mapped; ``get_slice`` reads only the rows or columns
asked for, so a tensor-parallel rank never reads more than its share). Never pickle.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.models.layers import reorder_linears
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.registry import model_class

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightError(LookupError):
    """A tensor is missing from the checkpoint, or a slice falls outside it."""


class WeightSource:
    """Read-only, name-addressed view of a checkpoint's tensors (HF names)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of = _index(self.model_dir)          # tensor name -> file name
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._open(name).get_tensor(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1 ...) ``[start, stop)`` of tensor ``name``, read alone."""
        view = self._open(name).get_slice(name)
        shape = view.get_shape()
        if not (0 <= dim < len(shape) and 0 <= start < stop <= shape[dim]):
            raise WeightError(f"slice [{start}, {stop}) on dim {dim} of {name} is outside its "
                              f"shape {tuple(shape)} ({self._path(name)})")
        return view[(slice(None),) * dim + (slice(start, stop),)]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, name: str):
        file = self._file_of.get(name)
        if file is None:
            where = INDEX_FILE if (self.model_dir / INDEX_FILE).is_file() else SINGLE_FILE
            raise WeightError(f"checkpoint tensor {name!r} is missing from {self.model_dir / where}")
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.model_dir / file), framework="pt")
        handle = self._handles[file]
        if name not in handle.keys():
            raise WeightError(f"checkpoint tensor {name!r} is missing from {self.model_dir / file} "
                              f"(the index {INDEX_FILE} lists it there)")
        return handle

    def _path(self, name: str) -> Path:
        return self.model_dir / self._file_of[name]


def load_model(model_dir: str | Path, dtype: str = "auto", *, first_layer: int = 0,
               num_layers: int | None = None, device: str = "cpu", tp_rank: int = 0, tp_size: int = 1):
    """-> (model in eval mode without grads, ModelConfig); the whole model by default.

    With ``tp_size > 1`` the model holds tensor-parallel shard ``tp_rank`` and reads only that
    share of each split tensor (``pdserve.engine.parallel.tp`` then wires the collectives)."""
    config = ModelConfig.from_dir(model_dir, dtype=dtype, device=device)
    kwargs = {}
    if tp_size > 1:
        from pdserve.engine.models.llama import ShardSizes

        kwargs["shard"] = ShardSizes.for_tp(config, tp_size)
    model = model_class(config.architecture)(config, first_layer=first_layer, num_layers=num_layers, **kwargs)
    with WeightSource(model_dir) as src:
        model.load_weights(src, tp_rank)
    model.to(device).eval().requires_grad_(False)
    logger.info("loaded %s from %s: %d layers [%d, %d), tp rank %d of %d, dtype %s", config.architecture,
                model_dir, model.num_layers, first_layer, first_layer + model.num_layers, tp_rank, tp_size,
                config.dtype)
    start = time.perf_counter()
    made, nbytes, panel_bytes = reorder_linears(model)
    if made:
        logger.info("reordered %d fp32 weights for oneDNN in %.2f s (a second copy: %.0f MiB; few-row panels, a "
                    "third: %.0f MiB)", made, time.perf_counter() - start, nbytes / 2**20, panel_bytes / 2**20)
    return model, config


def _index(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``model_dir``)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise WeightError(f"{index} has no 'weight_map'")
        return dict(weight_map)
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise WeightError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as handle:
        return {name: SINGLE_FILE for name in handle.keys()}
