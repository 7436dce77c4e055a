"""The fallback: a causal LM run through its own Hugging Face modules and HF `generate` — for architectures with no
native implementation, or `replace_with_kernel_inject=False` (for comparison). No kernels are injected; with
offload, its decoder layers stream from pinned CPU memory or NVMe exactly as the native models' do. HF modules'
layer loops cannot call the streamer, so here (only) it is called from forward pre/post hooks."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from tierllm.config import OffloadConfig
from tierllm.default_model import from_pretrained_args
from tierllm.offload.host_store import HostLayerStore
from tierllm.offload.nvme_store import NvmeLayerStore
from tierllm.offload.offload_model import gpu_budget_bytes
from tierllm.offload.placement import module_bytes, plan_placement
from tierllm.offload.streamer import LayerStreamer, ResidentLayers

logger = logging.getLogger("tierllm")


def decoder_layer_list(model: nn.Module) -> nn.ModuleList:
    """The ModuleList holding most of the parameters: the decoder layers, whatever the family calls them."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to stream")
    return max(lists, key=module_bytes)


def load_hf_model(source, dtype: torch.dtype):
    """A model object as is; a folder or .gguf file (None: the embedded SmolLM2) through from_pretrained."""
    from transformers import AutoModelForCausalLM
    if isinstance(source, nn.Module):
        return source
    name, kwargs = from_pretrained_args(source)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)


class HFFallbackModel:
    """An HF model placed on `device`, its decoder layers resident or streamed."""

    def __init__(self, hf_model: nn.Module, dtype: torch.dtype, device: torch.device,
                 offload: OffloadConfig | None = None, show_progress: bool = True):
        self.model = hf_model.to(dtype).eval()
        self.streamer: ResidentLayers | LayerStreamer = ResidentLayers()
        layers = decoder_layer_list(self.model)
        if offload is not None:
            self.model.to("cpu")
            self.streamer = self._stream_layers(layers, offload, dtype, device)
        self.model.to(device)
        self.hooks = []
        for i, layer in enumerate(layers):
            self.hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: self.streamer.before_layer(i)))
            self.hooks.append(layer.register_forward_hook(lambda *_, i=i: self.streamer.after_layer(i)))

    def _stream_layers(self, layers: nn.ModuleList, offload: OffloadConfig, dtype, device) -> LayerStreamer:
        config = self.model.config
        fixed = module_bytes(self.model) - sum(module_bytes(layer) for layer in layers)
        kv_per_token = 2 * config.num_hidden_layers * config.hidden_size * torch.empty((), dtype=dtype).element_size()
        budget = gpu_budget_bytes(offload, device, 0.9, module_bytes(self.model) + (1 << 30))
        plan = plan_placement(layers, fixed, offload, budget, kv_per_token, 1,
                              min(getattr(config, "max_position_embeddings", 2048), 2048), 2048,
                              config.vocab_size, dtype)
        if not plan.offloaded_layers:
            return ResidentLayers()
        offloaded = {i: layers[i] for i in plan.offloaded_layers}
        pin = offload.pin_memory and device.type == "cuda"
        store = (NvmeLayerStore(offloaded, offload.nvme_path, pin, plan.num_slots) if offload.device == "nvme"
                 else HostLayerStore(offloaded, pin))
        logger.info("tierllm: HF fallback streams %d of %d layers from %s", len(offloaded), len(layers), plan.tier)
        return LayerStreamer(layers, plan.offloaded_layers, store, device, plan.num_slots)


def _load_tokenizer(source):
    from transformers import AutoTokenizer
    name, kwargs = from_pretrained_args(source)
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError):
        return None


class HFFallbackEngine:
    """What init_inference returns for the fallback: HF `generate` (all its options), with `profile` timing."""

    def __init__(self, fallback: HFFallbackModel, tokenizer):
        self.fallback = fallback
        self.tokenizer = tokenizer
        self.profile = None

    @property
    def model(self) -> nn.Module:
        return self.fallback.model

    def close(self) -> None:
        """Release the layer streamer (NVMe files, loader threads); also done when the engine is collected."""
        self.fallback.streamer.close()

    @torch.inference_mode()
    def generate(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        from tierllm.api import GenerationProfile
        device = next(self.model.parameters()).device
        ids = torch.as_tensor(input_ids).to(device)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).to(device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, **kwargs)
        total = time.perf_counter() - start
        rows = out.shape[0]
        # HF generate reports no first-token time: the profile records the total only
        self.profile = GenerationProfile(rows, int(mask.sum()) * rows // ids.shape[0],
                                         rows * (out.shape[1] - ids.shape[1]), 0.0, total, total)
        return out


def fallback_reason(source, replace_with_kernel_inject: bool) -> str | None:
    """Why `source` must run through its HF modules, or None when the native engine takes it."""
    if not replace_with_kernel_inject:
        return "replace_with_kernel_inject=False"
    if source is None:
        return None                                            # the embedded SmolLM2: Llama family
    from tierllm.models.registry import NATIVE_MODELS
    if isinstance(source, nn.Module) or hasattr(source, "config"):     # a model, a Checkpoint, a preset source
        config = source.config
    else:
        folder = Path(source).expanduser()
        if not (folder / "config.json").is_file():
            return None                 # a GGUF file, or a path the checkpoint reader rejects with a clear error
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(str(folder))
    model_type = getattr(config, "model_type", None)
    return None if model_type in NATIVE_MODELS else f"model_type {model_type!r} has no native implementation"


_FALLBACK_OPTIONS = {"dtype", "device", "offload", "show_progress"}
_ENGINE_ONLY_FEATURES = {"kv_offload", "quant", "tensor_parallel"}      # need the native engine


def build_fallback_engine(source, tokenizer, reason: str, **options) -> HFFallbackEngine:
    from tierllm.api import _resolve_dtype
    unsupported = sorted(k for k, v in options.items() if k in _ENGINE_ONLY_FEATURES and v not in (None, False))
    if unsupported:
        raise ValueError(f"the HF fallback ({reason}) runs HF generate and does not take {unsupported}: those need "
                         "a natively supported model family")
    ignored = sorted(k for k in options if k not in _FALLBACK_OPTIONS | _ENGINE_ONLY_FEATURES)
    if ignored:
        logger.info("tierllm: the HF fallback sizes its own cache; ignoring %s", ignored)
    device = torch.device(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _resolve_dtype(options.get("dtype"), device)
    offload = options.get("offload")
    offload = OffloadConfig(**offload) if isinstance(offload, dict) else offload
    logger.warning("tierllm: kernels were not injected (%s): running the HF modules and HF generate%s", reason,
                   " with layer streaming" if offload else "")
    hf_model = load_hf_model(source, dtype)
    if tokenizer is None and not isinstance(source, nn.Module):
        tokenizer = _load_tokenizer(source)
    fallback = HFFallbackModel(hf_model, dtype, device, offload, options.get("show_progress", True))
    return HFFallbackEngine(fallback, tokenizer)
