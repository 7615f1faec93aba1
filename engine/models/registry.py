"""Architecture name -> model class, imported lazily.

``ModelConfig.from_dir`` calls ``check_supported`` (this module imports no model code, so the
config can be parsed without torch modules); ``loader.load_model`` calls ``model_class``.
A new architecture is one line in ``_MODELS`` plus its module.
"""

from __future__ import annotations

import importlib

# config.json "architectures"[0] -> (module under pdserve.engine.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "LlamaForCausalLM"),      # + MoE layers (moe.py)
    "MixtralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("llama", "LlamaForCausalLM"),
}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture pdserve has no model code for."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def check_supported(architecture: str) -> None:
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}")


def model_class(architecture: str) -> type:
    check_supported(architecture)
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pdserve.engine.models.{module_name}")
    return getattr(module, class_name)
