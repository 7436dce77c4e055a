"""A linear layer over quantized weights (int8 per channel, int4 group-wise, or W8A8), made from a Linear or
MergedLinear by tierllm/quant/quantize.py. Every tensor is an nn.Parameter (integer ones included, none
trainable), so `.to()`, state_dict, the strict loader and layer streaming see all of them."""
from __future__ import annotations

import torch
from torch import nn

from tierllm import kernels
from tierllm.config import QuantConfig
from tierllm.layers.linear import (Linear, _new_param, fusion_args, load_whole, reduce_partial_output,
                                   reduced_fused)


def packed_shapes(out_features: int, in_features: int, quant: QuantConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the packed weight tensors (tierllm/quant/formats.py)."""
    if quant.bits == 8:
        return {"qweight": (out_features, in_features), "scales": (out_features,)}
    if in_features % quant.group_size:
        raise ValueError(f"int4 group_size {quant.group_size} does not divide in_features {in_features}: choose "
                         "a group size that divides every linear's input size (e.g. 32 or 64)")
    groups = (out_features, in_features // quant.group_size)
    shapes = {"qweight": (out_features, in_features // 2), "scales": groups}
    if not quant.symmetric:
        shapes["mins"] = groups
    return shapes


class QuantLinear(nn.Module):
    """y = x dequant(W)^T + b for W: [out_features, in_features] stored packed (formats.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig, dtype: torch.dtype,
                 device=None, output_sizes: dict | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.output_sizes = dict(output_sizes) if output_sizes else None     # shard id -> rows (fused QKV ...)
        self.parallel = None                  # tensor-parallel group, as on Linear
        self.reduce_output = False            # row-parallel: all-reduce the local matmul, then add the bias
        dtypes = {"qweight": torch.int8 if quant.bits == 8 else torch.uint8}
        for name, shape in packed_shapes(out_features, in_features, quant).items():
            param = _new_param(*shape, dtype=dtypes.get(name, torch.float16), device=device)
            param.weight_loader = load_whole
            self.register_parameter(name, param)
        if "mins" not in self._parameters:
            self.register_parameter("mins", None)                          # symmetric int4, int8
        self.bias = None
        if bias:
            self.bias = _new_param(out_features, dtype=dtype, device=device)
            self.bias.weight_loader = load_whole

    @classmethod
    def like(cls, linear: Linear, quant: QuantConfig) -> QuantLinear:
        """An empty QuantLinear in the place of `linear`: same (local) shape, bias, device and shards, and every
        public attribute of `linear` (tensor-parallel state: `parallel`, `reduce_output`, slices) carried over."""
        if type(linear).forward is not Linear.forward:
            raise NotImplementedError(
                f"cannot quantize {type(linear).__name__}: its forward() differs from Linear's, and QuantLinear "
                "would silently drop what it adds. Express the extra step through Linear's attributes (e.g. "
                "reduce_output) or teach QuantLinear.forward the same step.")
        bias = linear.bias
        qlinear = cls(linear.in_features, linear.out_features, bias is not None, quant, linear.weight.dtype,
                      linear.weight.device, getattr(linear, "output_sizes", None))
        for attr, value in vars(linear).items():
            if not attr.startswith("_") and attr != "training":
                setattr(qlinear, attr, value)
        return qlinear

    @torch.no_grad()
    def load_quantized(self, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None) -> None:
        """Fill from quantize_weight()'s output (and the dense layer's bias)."""
        expected = set(packed_shapes(self.out_features, self.in_features, self.quant))
        if set(tensors) != expected:
            raise ValueError(f"quantized tensors {sorted(tensors)} do not match {self.quant.name} ({sorted(expected)})")
        for name, tensor in tensors.items():
            load_whole(getattr(self, name), tensor)
        if bias is not None:
            load_whole(self.bias, bias)

    def forward(self, x: torch.Tensor, k_order: bool = False) -> torch.Tensor:   # [num_tokens, in] -> [.., out]
        """k_order: x's columns are in the int4 wgmma GEMM's k order (where takes_k_order said so)."""
        if self.reduce_output:                              # the bias once, after the sum
            return reduce_partial_output(self.partial_output(x, k_order), self.bias, self.parallel)
        return self._matmul(x, self.bias, k_order)

    def partial_output(self, x: torch.Tensor, k_order: bool = False) -> torch.Tensor:
        """This rank's share of a row-parallel output, before the all-reduce and the bias."""
        return self._matmul(x, None, k_order)

    def takes_k_order(self, x: torch.Tensor) -> bool:
        """Whether forward() takes x (of these rows, device and dtype) in the int4 wgmma GEMM's k order, which the
        norm or activation before it then writes (models/llama.py): int4 weight-only at 9-64 rows on an H100/H200."""
        return self.quant.activations is None and kernels.takes_x_in_k_order(x, self.in_features, self.quant.bits,
                                                                             self.quant.group_size)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, k_order: bool = False) -> torch.Tensor:
        if self.quant.activations == "int8":
            return kernels.w8a8_linear(x, self.qweight, self.scales, bias)
        return kernels.quant_linear(x, self.qweight, self.scales, self.mins, self.quant.bits, self.quant.group_size,
                                    bias, x_in_k_order=k_order)

    @property
    def takes_rotary(self) -> bool:
        """Whether fused() takes a kernels.DecodeRotary (a QKV projection's int4 GEMV can rotate in its epilogue)."""
        return self.quant.bits == 4 and self.quant.activations is None and not self.reduce_output

    def fused(self, x: torch.Tensor, *, norm=None, gated: bool = False, residual: torch.Tensor | None = None,
              rotary: kernels.DecodeRotary | None = None) -> torch.Tensor:
        """As Linear.fused, through kernels.fused_quant_linear (the fusions that pay inside the quantized GEMV: see
        GEMV_FUSIONS there); W8A8 runs them as separate kernels, all-reduced outputs through reduced_fused.
        rotary (where takes_rotary): the decode token's rotary embedding and cache write, done on the output."""
        if rotary is not None and not self.takes_rotary:
            raise ValueError(f"rotary is for an int4 weight-only projection, not {self.quant.name}")
        if self.reduce_output:
            return reduced_fused(self, x, norm, gated, residual)
        fusions = fusion_args(norm, gated, residual)
        if self.quant.activations == "int8":
            return kernels.unfused_linear(x, self, **fusions)
        # decode chained by programmatic dependent launch where the GPU has it, as Linear.fused's GEMVs
        return kernels.fused_quant_linear(x, self.qweight, self.scales, self.mins, self.quant.bits,
                                          self.quant.group_size, self.bias, **fusions, pdl=True, rotary=rotary)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[num_tokens, sum(sizes)] -> one view per shard (fused projections only)."""
        if self.output_sizes is None:
            raise TypeError("split() is for fused projections (made from a MergedLinear)")
        return y.split(list(self.output_sizes.values()), dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, quant={self.quant.name}"
