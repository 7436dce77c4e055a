"""Quantize dense weights (round to nearest) and convert a loaded native model's decoder-layer linears into
QuantLinear modules. Layouts: tierllm/quant/formats.py."""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from tierllm.config import QuantConfig
from tierllm.layers.linear import Linear
from tierllm.layers.quant_linear import QuantLinear
from tierllm.quant.formats import INT8_MAX, SCALE_DTYPE, pack_int4


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] -> {"qweight": int8 [N, K], "scales": fp16 [N]} (per output channel, symmetric)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-8).to(SCALE_DTYPE)          # [N]
    q = torch.round(w / scales.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return {"qweight": q.to(torch.int8), "scales": scales}


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """[N, K] -> {"qweight": uint8 [N, K // 2], "scales": fp16 [N, K // G] (+ "mins" when asymmetric)}."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide in_features {k}: choose a group size "
                         "that divides every linear's input size (e.g. 32 or 64)")
    w = weight.float().view(n, k // group_size, group_size)                            # [N, K // G, G]
    if symmetric:
        scales = (w.abs().amax(dim=-1) / 7).clamp(min=1e-8).to(SCALE_DTYPE)             # [N, K // G]
        codes = torch.round(w / scales.float()[..., None]).clamp_(-7, 7) + 8
        mins = None
    else:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-8).to(SCALE_DTYPE)
        mins = low.to(SCALE_DTYPE)
        codes = torch.round((w - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    out = {"qweight": pack_int4(codes.view(n, k).to(torch.uint8)), "scales": scales}
    if mins is not None:
        out["mins"] = mins
    return out


def quantize_weight(weight: torch.Tensor, quant: QuantConfig) -> dict[str, torch.Tensor]:
    """A dense [out_features, in_features] weight -> the packed tensors of a QuantLinear (formats.py)."""
    if quant.bits == 8:
        return quantize_int8(weight)
    return quantize_int4(weight, quant.group_size, quant.symmetric)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: its largest ModuleList (model.layers, decoder.layers, h, ...)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers to quantize")
    return max(lists, key=len)


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, linear) for every Linear / MergedLinear inside the decoder layers."""
    found = []
    for layer in decoder_layers(model):
        for parent in layer.modules():
            for attr, child in parent.named_children():
                if isinstance(child, Linear):
                    found.append((parent, attr, child))
    return found


@torch.no_grad()
def quantize_model(model: nn.Module, quant: QuantConfig, show_progress: bool = True) -> nn.Module:
    """Replace every decoder-layer linear with a QuantLinear holding its quantized (local) weight, in place.
    Each dense weight is freed as soon as its replacement exists, so peak memory grows by one linear."""
    linears = quantizable_linears(model)
    for parent, attr, linear in tqdm(linears, desc=f"Quantizing ({quant.name})", unit="linear",
                                     disable=not show_progress, leave=False):
        qlinear = QuantLinear.like(linear, quant)
        qlinear.load_quantized(quantize_weight(linear.weight, quant), linear.bias)
        setattr(parent, attr, qlinear)
    return model


def convert_to_quant_shells(model: nn.Module, quant: QuantConfig) -> nn.Module:
    """Replace every decoder-layer linear with an empty QuantLinear (for loading an already quantized
    checkpoint: nothing is quantized, the stored tensors fill the shells)."""
    for parent, attr, linear in quantizable_linears(model):
        setattr(parent, attr, QuantLinear.like(linear, quant))
    return model
