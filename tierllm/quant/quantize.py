"""Quantize dense weights (round to nearest) and convert a loaded native model's decoder-layer linears into
QuantLinear modules (method "gptq": tierllm/quant/gptq.py). Layouts: tierllm/quant/formats.py."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from tierllm.config import QuantConfig
from tierllm.layers.embedding import ParallelLMHead
from tierllm.layers.linear import Linear
from tierllm.layers.quant_linear import QuantLinear
from tierllm.layers.quant_lm_head import QuantLMHead
from tierllm.quant.formats import INT8_MAX, SCALE_DTYPE, pack_int4


def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """[N, K] -> {"qweight": int8 [N, K], "scales": fp16 [N]} (per output channel, symmetric). row_absmax [N]:
    the channels' max |w| over whole rows when `weight` holds only part of each (a row-parallel shard)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()
    scales = (absmax / INT8_MAX).clamp(min=1e-8).to(SCALE_DTYPE)                        # [N]
    q = torch.round(w / scales.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return {"qweight": q.to(torch.int8), "scales": scales}


_REFINE_STEPS = 4                  # alternating least-squares steps of the int4 grid fit


def _fit_int4_grid(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """w: [N, K // G, G] -> (scales, mins or None, codes): per group, the affine 16-level grid that lowers the
    squared error of round-to-nearest. Starts from the min/max (or max |w|) grid, then alternates rounding with
    a least-squares refit of scale (and min); a step is kept only for the groups whose error it lowers. Scales
    and mins are rounded to fp16 inside the loop, so the codes fit the stored values."""
    def grid(scales, mins):
        if symmetric:
            codes = torch.round(w / scales[..., None]).clamp_(-8, 7)
            return codes, ((codes * scales[..., None] - w) ** 2).sum(-1)
        codes = torch.round((w - mins[..., None]) / scales[..., None]).clamp_(0, 15)
        return codes, ((codes * scales[..., None] + mins[..., None] - w) ** 2).sum(-1)

    def to_fp16(t):
        return t.to(SCALE_DTYPE).float()

    if symmetric:
        scales, mins = to_fp16((w.abs().amax(dim=-1) / 7).clamp(min=1e-8)), None
    else:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales, mins = to_fp16(((high - low) / 15).clamp(min=1e-8)), to_fp16(low)
    codes, err = grid(scales, mins)
    g = w.shape[-1]
    for _ in range(_REFINE_STEPS):
        sum_qw, sum_qq = (codes * w).sum(-1), (codes * codes).sum(-1)
        if symmetric:
            new_scales, new_mins = to_fp16((sum_qw / sum_qq.clamp(min=1)).clamp(min=1e-8)), None
        else:
            sum_q, sum_w = codes.sum(-1), w.sum(-1)
            det = g * sum_qq - sum_q * sum_q                                               # 0: all codes equal
            slope = (g * sum_qw - sum_q * sum_w) / det.clamp(min=1e-12)
            new_scales = to_fp16(torch.where(det > 0, slope, scales).clamp(min=1e-8))
            new_mins = to_fp16((sum_w - new_scales * sum_q) / g)
        new_codes, new_err = grid(new_scales, new_mins)
        better = new_err < err                                                             # [N, K // G]
        scales = torch.where(better, new_scales, scales)
        mins = None if symmetric else torch.where(better, new_mins, mins)
        codes = torch.where(better[..., None], new_codes, codes)
        err = torch.minimum(new_err, err)
    return scales, mins, (codes + 8 if symmetric else codes)


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """[N, K] -> {"qweight": uint8 [N, K // 2], "scales": fp16 [N, K // G] (+ "mins" when asymmetric)}."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide in_features {k}: choose a group size "
                         "that divides every linear's input size (e.g. 32 or 64)")
    w = weight.float().view(n, k // group_size, group_size)                            # [N, K // G, G]
    scales, mins, codes = _fit_int4_grid(w, symmetric)
    out = {"qweight": pack_int4(codes.view(n, k).to(torch.uint8)), "scales": scales.to(SCALE_DTYPE)}
    if mins is not None:
        out["mins"] = mins.to(SCALE_DTYPE)
    return out


def quantize_weight(weight: torch.Tensor, quant: QuantConfig) -> dict[str, torch.Tensor]:
    """A dense [out_features, in_features] weight -> the packed tensors of a QuantLinear (formats.py), rounded
    to nearest. GPTQ needs the model's activations: quantize_model runs it (tierllm/quant/gptq.py)."""
    if quant.method != "rtn":
        raise ValueError(f"quantize_weight rounds one weight to nearest (method 'rtn'); method {quant.method!r} "
                         "needs calibration activations: quantize the whole model with quantize_model")
    if quant.bits == 8:
        return quantize_int8(weight)
    return quantize_int4(weight, quant.group_size, quant.symmetric)


def layer_linears(layer: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, linear) for every Linear / MergedLinear inside one decoder layer."""
    return [(parent, attr, child) for parent in layer.modules() for attr, child in parent.named_children()
            if isinstance(child, Linear)]


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, linear) for every Linear / MergedLinear inside the decoder layers."""
    return [entry for layer in model.decoder_layers() for entry in layer_linears(layer)]


@torch.no_grad()
def quantize_model(model: nn.Module, quant: QuantConfig, show_progress: bool = True,
                   calibration: list[list[int]] | None = None, max_len: int | None = None) -> nn.Module:
    """Replace every decoder-layer linear with a QuantLinear holding its quantized (local) weight, in place (and
    the LM head with a QuantLMHead where quant.lm_head). Each dense weight is freed as soon as its replacement
    exists, so peak memory grows by one linear.
    quant.method "gptq" calibrates on `calibration` (token-id sequences; default: sampled from the model), cut to
    `max_len` tokens (the positions the model was built for)."""
    if quant.method == "gptq":
        from tierllm.quant.gptq import quantize_model_gptq
        quantize_model_gptq(model, quant, calibration, show_progress=show_progress, max_len=max_len)
    else:
        linears = quantizable_linears(model)
        for parent, attr, linear in tqdm(linears, desc=f"Quantizing ({quant.name})", unit="linear",
                                         disable=not show_progress, leave=False):
            tensors = _quantize_shard(linear, quant)
            qlinear = QuantLinear.like(linear, quant)
            qlinear.load_quantized(tensors, linear.bias)
            setattr(parent, attr, qlinear)
    if quant.lm_head:
        quantize_lm_head(model)
    return model


def _native_head(model: nn.Module) -> ParallelLMHead:
    """The model's vocab-parallel LM head (a clear error for models without one)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, ParallelLMHead):
        raise ValueError(f"QuantConfig(lm_head=True) quantizes the LM head of tierllm's native models; "
                         f"{type(model).__name__} has none: drop lm_head=True")
    return head


@torch.no_grad()
def quantize_lm_head(model: nn.Module) -> nn.Module:
    """Replace the model's LM head with its int8 round to nearest (QuantLMHead), in place. A head tied to the
    embedding gets its own int8 copy; the embedding stays as it was."""
    head = _native_head(model)
    qhead = QuantLMHead(head)
    qhead.load_quantized(quantize_int8(head.dense_weight), None)
    model.lm_head = qhead
    return model


def _quantize_shard(linear: Linear, quant: QuantConfig) -> dict[str, torch.Tensor]:
    """quantize_weight of this rank's shard, giving the codes and scales of TP=1's weight. A column-parallel
    shard holds whole rows: nothing changes. A row-parallel one holds a K slice of every row: int8's per-channel
    scale takes the max |w| over the whole row (a MAX all-reduce over the ranks, in the same linear order on
    every rank), and int4's groups stay TP=1's only if the slice is a whole number of groups."""
    parallel = linear.parallel
    if not linear.reduce_output or parallel is None or parallel.tp_size == 1:
        return quantize_weight(linear.weight, quant)
    k = linear.weight.shape[1]
    if quant.bits == 4 and k % quant.group_size:
        raise ValueError(f"int4 group_size {quant.group_size} does not divide {k}, the input size of this rank's "
                         f"slice of a row-parallel linear (tp_size={parallel.tp_size}): choose a group size that "
                         f"divides it, or another tp_size")
    if quant.bits != 8:
        return quantize_weight(linear.weight, quant)
    absmax = linear.weight.float().abs().amax(dim=1).to(parallel.device)               # [N], this slice
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=parallel.group)
    return quantize_int8(linear.weight, absmax.to(linear.weight.device))


def convert_to_quant_shells(model: nn.Module, quant: QuantConfig) -> nn.Module:
    """Replace every decoder-layer linear (and, where quant.lm_head, the LM head) with an empty quantized shell
    (for loading an already quantized checkpoint: nothing is quantized, the stored tensors fill the shells)."""
    for parent, attr, linear in quantizable_linears(model):
        setattr(parent, attr, QuantLinear.like(linear, quant))
    if quant.lm_head:
        model.lm_head = QuantLMHead(_native_head(model))
    return model
