"""Quantized benchmark presets built layer by layer: a Checkpoint whose tensors are generated lazily, one
linear at a time (random bf16 weight -> quantized on the spot), so no dense copy of the whole model ever
exists (a bf16 `llama-70b` fits neither the GPU nor host memory). Load it like a folder written by
`tierllm quantize`: init_inference(preset_quant_checkpoint(...))."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from tierllm.bench.presets import RandomPool, preset_config
from tierllm.config import QuantConfig
from tierllm.layers.quant_linear import QuantLinear
from tierllm.models.registry import resolve_model_class
from tierllm.quant.quantize import convert_to_quant_shells, quantize_weight
from tierllm.weights.checkpoint import Checkpoint


def _tensors(skeleton: torch.nn.Module, quant: QuantConfig, pool: RandomPool) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in skeleton.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, QuantLinear):
            dense = pool.tensor((module.out_features, module.in_features))              # [out, in], this linear only
            for name, tensor in quantize_weight(dense, module.quant).items():   # an int8 LM head's own
                yield prefix + name, tensor
            del dense
            if module.bias is not None:
                yield prefix + "bias", pool.tensor(module.bias.shape)
            continue
        for name, param in module.named_parameters(recurse=False):
            is_norm = "norm" in module_name or "ln" in module_name.rsplit(".", 1)[-1]
            yield prefix + name, pool.tensor(param.shape, is_norm)


def preset_quant_checkpoint(name: str, quant: QuantConfig | dict | str, dtype: torch.dtype = torch.bfloat16,
                            device: torch.device | str | None = None, seed: int = 0) -> Checkpoint:
    """A quantized checkpoint of preset `name` with random weights, generated (and quantized) on `device`
    (default: CUDA if present) one linear at a time as the loader asks for it."""
    quant = QuantConfig.from_any(quant)
    if quant.method != "rtn":
        raise ValueError(f"benchmark presets have random weights and no calibration data: quantize them with "
                         f"method='rtn', not {quant.method!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = preset_config(name)
    skeleton = resolve_model_class(config)(config, 16, dtype, torch.device("meta"))   # names and shapes only
    convert_to_quant_shells(skeleton, quant)
    num_tensors = len(dict(skeleton.named_parameters()))
    return Checkpoint(config, num_tensors, _tensors(skeleton, quant, RandomPool(dtype, device, seed)), None,
                      f"preset {name} ({quant.name}, random weights)", None, quant)
