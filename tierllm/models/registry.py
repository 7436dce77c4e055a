"""HF model_type -> native implementation."""
from __future__ import annotations

from tierllm.models.gpt2 import GPT2LMHeadModel
from tierllm.models.llama import LlamaForCausalLM
from tierllm.models.opt import OPTForCausalLM

NATIVE_MODELS = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "opt": OPTForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


class UnsupportedArchitectureError(ValueError):
    pass


def resolve_model_class(config):
    model_type = getattr(config, "model_type", None)
    if model_type not in NATIVE_MODELS:
        arch = (getattr(config, "architectures", None) or [model_type])[0]
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} (model_type {model_type!r}) has no native tierllm implementation; "
            f"supported model types: {', '.join(sorted(NATIVE_MODELS))}. tierllm.init_inference still runs it through its "
            "HF modules and HF generate (with layer streaming if offloaded); the batching engine (LLM, serve) needs "
            "a native family: convert the model to one of these or open an issue for it.")
    return NATIVE_MODELS[model_type]
