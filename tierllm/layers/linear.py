"""Linear layers whose parameters load themselves from checkpoint tensors (whole, or one shard of a fused
projection such as QKV or gate/up), and their tensor-parallel forms: each rank loads its own slice of the full
checkpoint tensor. `weight`, `bias`, `in_features`, `out_features` and `output_sizes` always describe the local
shard (the whole tensor when tp_size=1)."""
from __future__ import annotations

import torch
from torch import nn

from tierllm import kernels
from tierllm.distributed.comm import all_reduce
from tierllm.distributed.parallel_state import ParallelState
from tierllm.distributed.sharding import RowSlice, even_slice, head_slice


def _new_param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} vs parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def take_slice(loaded: torch.Tensor, part: RowSlice, dim: int) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor along `dim`, after checking the full size."""
    if loaded.shape[dim] != part.full_rows:
        raise ValueError(f"checkpoint tensor {tuple(loaded.shape)} has {loaded.shape[dim]} along dim {dim}, "
                         f"expected {part.full_rows}")
    return loaded.narrow(dim, part.start, part.rows)


def reduce_partial_output(y: torch.Tensor, bias: torch.Tensor | None, parallel: ParallelState,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """The row-parallel epilogue: sum the ranks' partial outputs, then add the bias once; the result in `dtype`
    (y's dtype by default)."""
    y = all_reduce(y, parallel)                                        # [num_tokens, out]
    y = y if bias is None else y + bias
    return y if dtype is None else y.to(dtype)


def reduced_fused(layer, x: torch.Tensor, norm, gated: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """Linear.fused for a row-parallel layer: the sum must come before the residual add. Added into a residual:
    residual += the sum of the ranks' `layer.partial_output(x)` plus the bias, rounded to the residual's dtype,
    in place (returns residual): one kernel for the GEMV, the all-reduce and the add where the fused all-reduce
    is on and takes the call (distributed/fused_all_reduce.py), else one kernel after the all-reduce; otherwise
    the separate kernels."""
    if residual is not None and norm is None and not gated:
        fused = layer.parallel.fused_all_reduce
        if fused is not None and isinstance(layer, Linear):           # never on in invariant mode
            done = fused(x, layer.weight, layer.bias, residual)
            if done is not None:
                return done
        summed = all_reduce(layer.partial_output(x), layer.parallel)    # [num_tokens, out]
        return kernels.add_rounded_(residual, summed, layer.bias)
    return kernels.unfused_linear(x, layer, **fusion_args(norm, gated, residual))


def partial_sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Row-parallel partial sums of fp16/bf16 layers stay fp32 through the all-reduce: rounding every rank's
    partial to 8 mantissa bits before the sum adds noise that TP=1 (one rounding of the whole sum) does not have.
    The all-reduce moves twice the bytes; at decode sizes it is latency-bound, so that costs little."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class Linear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features], this rank's shard.

    reduce_output (row-parallel): y is this rank's partial sum; forward all-reduces it over `parallel`'s group
    and adds the bias once, after the reduce. A module that replaces a Linear after loading (e.g. a quantized
    one) keeps the local weight, copies `parallel` and `reduce_output`, has `partial_output(x)` (y without the
    bias, not reduced), and, when reduce_output is set, ends its forward with
    `reduce_partial_output(self.partial_output(x), bias, parallel)`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _new_param(out_features, in_features, dtype=dtype, device=device)
        self.weight.weight_loader = load_whole
        self.bias = None
        if bias:
            self.bias = _new_param(out_features, dtype=dtype, device=device)
            self.bias.weight_loader = load_whole
        self.parallel: ParallelState | None = None       # the tensor-parallel group (parallel subclasses)
        self.reduce_output = False                        # all-reduce y over `parallel` (row-parallel)
        self.invariant_parts = 0                          # K parts of kernels.invariant_linear; 0: the fast kernels

    def forward(self, x: torch.Tensor, k_order: bool = False) -> torch.Tensor:   # [num_tokens, in] -> [.., out]
        if k_order:
            raise ValueError(f"{type(self).__name__} takes x in its usual column order (takes_k_order is False)")
        if self.reduce_output:
            return reduce_partial_output(self.partial_output(x), self.bias, self.parallel, x.dtype)
        return self.matmul(x, self.bias)

    def takes_k_order(self, x: torch.Tensor) -> bool:
        """Whether forward() takes x in the int4 wgmma GEMM's k order: never for a dense weight (QuantLinear's)."""
        return False

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.invariant_parts:
            return kernels.invariant_linear(x, self.weight, bias, self.invariant_parts, out_dtype)
        return kernels.linear(x, self.weight, bias, out_dtype)

    def partial_output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a row-parallel output, before the all-reduce and the bias (fp32 for fp16/bf16)."""
        return self.matmul(x, None, partial_sum_dtype(x.dtype))

    def fused(self, x: torch.Tensor, *, norm=None, gated: bool = False,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """forward() with its neighbours folded in: `norm` (an RMSNorm) applied to x first, SiLU-and-mul of the
        [gate | up] output (gated), or the output added into `residual` in place (returns `residual`). One GEMV
        kernel for decode-sized batches on CUDA (kernels.fused_linear); the separate kernels otherwise. An
        all-reduced output: reduced_fused."""
        if self.reduce_output:
            return reduced_fused(self, x, norm, gated, residual)
        if self.invariant_parts:
            return kernels.unfused_linear(x, self, **fusion_args(norm, gated, residual))
        # Decode's GEMVs are chained by programmatic dependent launch where the GPU has it: each loads its first
        # weights while the kernel before it finishes (kernels/gemv.py).
        return kernels.fused_linear(x, self.weight, self.bias, **fusion_args(norm, gated, residual), pdl=True)


def fusion_args(norm, gated: bool, residual: torch.Tensor | None) -> dict:
    """The keyword arguments of kernels.fused_linear / unfused_linear for Linear.fused's options."""
    return {"norm_weight": None if norm is None else norm.weight, "eps": 1e-6 if norm is None else norm.eps,
            "gated": gated, "residual": residual}


def invariant_column_parts(parallel: ParallelState) -> int:
    """Column-parallel layers in invariant mode: the whole K in one part (only N is split over the ranks)."""
    return 1 if parallel.invariant_parts else 0


def invariant_row_parts(in_features: int, parallel: ParallelState) -> int:
    """Row-parallel layers in invariant mode: this rank's share of the K parts (distributed/parallel_state.py's
    INVARIANT_PARTS over tp_size), which need in_features to split evenly."""
    if not parallel.invariant_parts:
        return 0
    if in_features % parallel.invariant_parts:
        raise ValueError(f"tensor_parallel invariant=True cuts each row-parallel layer's {in_features} input "
                         f"features into {parallel.invariant_parts} equal parts, and they do not divide: run this "
                         "model without invariant")
    return parallel.invariant_parts // parallel.tp_size


class ColumnParallelLinear(Linear):
    """Output features split over the ranks: rank r holds output rows [r * out/tp, (r + 1) * out/tp) and its
    output stays split (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device,
                 parallel: ParallelState):
        out_slice = even_slice(out_features, parallel.tp_rank, parallel.tp_size)
        super().__init__(in_features, out_slice.rows, bias, dtype, device)
        self.out_slice = out_slice                                 # rows of the checkpoint tensor held here
        self.parallel = parallel
        self.invariant_parts = invariant_column_parts(parallel)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_whole(param, take_slice(loaded, self.out_slice, 0))


class RowParallelLinear(Linear):
    """Input features split over the ranks (the input is a column-parallel output): rank r holds input columns
    [r * in/tp, (r + 1) * in/tp); the partial outputs are all-reduced in forward, the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device,
                 parallel: ParallelState):
        in_slice = even_slice(in_features, parallel.tp_rank, parallel.tp_size)
        super().__init__(in_slice.rows, out_features, bias, dtype, device)
        self.in_slice = in_slice                                   # columns of the checkpoint tensor held here
        self.parallel = parallel
        # invariant mode: TP=1 too sums fp32 parts and rounds once after the (no-op) reduce, as TP=N does
        self.reduce_output = parallel.tp_size > 1 or bool(parallel.invariant_parts)
        self.invariant_parts = invariant_row_parts(in_features, parallel)
        self.weight.weight_loader = self._load_columns            # the bias is whole on every rank

    def _load_columns(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_whole(param, take_slice(loaded, self.in_slice, 1))


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dimension, e.g. QKV = {"q","k","v"} or
    gate_up = {0, 1}. Each checkpoint tensor fills its shard; the loader checks that every shard arrived.
    source_slices: the rows of each full checkpoint tensor this rank holds (tensor parallelism; None = all).
    is_packed: the checkpoint stores all shards as one tensor (GPT-2's c_attn), loaded with shard id None."""

    def __init__(self, in_features: int, output_sizes: dict, bias: bool, dtype: torch.dtype, device=None,
                 source_slices: dict[object, RowSlice] | None = None, is_packed: bool = False):
        super().__init__(in_features, sum(output_sizes.values()), bias, dtype, device)
        self.output_sizes = dict(output_sizes)                # shard id -> local rows
        self.source_slices = source_slices or {k: RowSlice(n, 0, n) for k, n in output_sizes.items()}
        self.is_packed = is_packed
        offsets, offset = {}, 0
        for shard_id, size in output_sizes.items():
            offsets[shard_id] = offset
            offset += size
        self.offsets = offsets
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard
                param.shard_ids = (None,) if is_packed else tuple(output_sizes)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        if shard_id is None and self.is_packed:
            full_sizes = [part.full_rows for part in self.source_slices.values()]
            if loaded.shape[0] != sum(full_sizes):
                raise ValueError(f"packed checkpoint tensor {tuple(loaded.shape)} should have {sum(full_sizes)} "
                                 f"rows ({full_sizes})")
            for sid, part in zip(self.output_sizes, loaded.split(full_sizes, dim=0), strict=True):
                self._load_shard(param, part, sid)
            return
        if shard_id not in self.output_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.output_sizes)}")
        loaded = take_slice(loaded, self.source_slices[shard_id], 0)
        target = param.data.narrow(0, self.offsets[shard_id], self.output_sizes[shard_id])
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint tensor {tuple(loaded.shape)} "
                             f"vs {tuple(target.shape)}")
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[num_tokens, sum(sizes)] -> one view per shard."""
        return y.split(list(self.output_sizes.values()), dim=-1)


class MergedColumnParallelLinear(MergedLinear):
    """Column-parallel over each projection separately (gate/up): rank r holds rows [r * n/tp, (r + 1) * n/tp) of
    every shard, so its fused output is [gate_r | up_r]."""

    def __init__(self, in_features: int, full_sizes: dict, bias: bool, dtype: torch.dtype, device,
                 parallel: ParallelState):
        slices = {k: even_slice(n, parallel.tp_rank, parallel.tp_size) for k, n in full_sizes.items()}
        super().__init__(in_features, {k: s.rows for k, s in slices.items()}, bias, dtype, device, slices)
        self.parallel = parallel
        self.invariant_parts = invariant_column_parts(parallel)


class QKVParallelLinear(MergedLinear):
    """Fused Q/K/V split by attention heads: rank r holds num_heads/tp query heads and num_kv_heads/tp KV heads;
    with fewer KV heads than ranks (GQA) each rank holds one KV head, replicated (rank r: head
    r * num_kv_heads // tp_size). Shard ids "q", "k", "v", or one packed tensor (GPT-2)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 dtype: torch.dtype, device, parallel: ParallelState, is_packed: bool = False):
        rank, size = parallel.tp_rank, parallel.tp_size
        slices = {"q": head_slice(num_heads, head_dim, rank, size),
                  "k": head_slice(num_kv_heads, head_dim, rank, size),
                  "v": head_slice(num_kv_heads, head_dim, rank, size)}
        super().__init__(hidden_size, {k: s.rows for k, s in slices.items()}, bias, dtype, device, slices, is_packed)
        self.parallel = parallel
        self.invariant_parts = invariant_column_parts(parallel)
        self.num_local_heads = slices["q"].rows // head_dim          # query heads on this rank
        self.num_local_kv_heads = slices["k"].rows // head_dim       # KV heads on this rank
