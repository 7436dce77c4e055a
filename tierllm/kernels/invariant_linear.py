"""A matmul whose every output element comes out bitwise the same whatever the tensor-parallel split:
y[M, N] = x[M, K] @ W[N, K]^T (+ b), fp32 accumulation, for `tensor_parallel={"invariant": True}`.

- Columns: one fixed tile config per M bucket (never the autotuner, never cuBLAS, whose kernel choice depends on
  N), no split K: an output element's arithmetic does not depend on N, so a column-parallel shard computes TP=1's
  bits for its columns.
- Rows (row-parallel layers): K is cut into `parts` equal parts; each part is summed from its own start in
  BLOCK_K steps, and the parts' fp32 sums are added in a pairwise tree ((s0 + s1) + (s2 + s3)). A rank holding
  parts [r * S / t, (r + 1) * S / t) of a TP=t split computes the subtree of its parts; the ranks' partials,
  gathered and added in the same tree (distributed/comm.ordered_all_reduce), are the whole tree: TP=1's bits.

On CUDA one Triton program per (tile, part) writes the parts' fp32 sums and a second kernel adds them (eight K
loops in one program ran 5-8x slower than cuBLAS at prefill sizes: benchmarks/results/invariant-sweep*.json); the
torch reference (fp32 dot products per part, the same tree) is the CPU path and the test oracle. Each is
invariant on its own; they do not match each other bitwise."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, use_triton

SUPPORTED_PARTS = (1, 2, 4, 8)  # the pairwise trees _tree_kernel spells out
PARTIAL_ROWS = 1024          # rows per launch of a multi-part matmul: bounds its fp32 partials to parts x 1024 x N

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _part_kernel(x_ptr, w_ptr, out_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_op,
                     PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (m tile, n tile, part p): sum over k in part p = [p * K / PARTS, (p + 1) * K / PARTS) of
        x[m, k] * W[n, k], in BLOCK_K steps from the part's start (the masked last step is the same wherever the
        part lies in K) -> out[p, m, n]: fp32 partials (PARTS > 1), or y itself (one part: + bias, y's dtype)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        part = tl.program_id(2)
        m_mask, n_mask = offs_m < M, offs_n < N
        part_len = K // PARTS
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        offs_kb = tl.arange(0, BLOCK_K)
        for k0 in range(0, part_len, BLOCK_K):
            k_mask = k0 + offs_kb < part_len
            offs_k = part * part_len + k0 + offs_kb
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)                # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)                # [BLOCK_N, BLOCK_K]
            if IEEE:                                       # fp32 inputs: no TF32 rounding of the operands
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + part.to(tl.int64) * stride_op + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _tree_kernel(parts_ptr, b_ptr, y_ptr, numel, N, stride_p, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
        """y = tree_sum(parts[0..PARTS)) (+ bias) in y's dtype, pairwise as tree_sum, for PARTS of 2, 4 or 8."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        p = parts_ptr + offs
        acc = tl.load(p, mask=mask) + tl.load(p + stride_p, mask=mask)
        if PARTS >= 4:
            acc += tl.load(p + 2 * stride_p, mask=mask) + tl.load(p + 3 * stride_p, mask=mask)
        if PARTS == 8:
            acc += ((tl.load(p + 4 * stride_p, mask=mask) + tl.load(p + 5 * stride_p, mask=mask))
                    + (tl.load(p + 6 * stride_p, mask=mask) + tl.load(p + 7 * stride_p, mask=mask)))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _tile_config(m: int, dtype: torch.dtype) -> dict:
    """A function of M and the dtype only (never of N or K): decode-sized M gets narrow tiles so that a weight is
    spread over enough programs; fp32 tiles take twice the shared memory per stage; the interpreter gets small
    tiles (speed)."""
    if is_interpreted():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4}
    wide = dtype == torch.float32
    # the fastest of 7 decode tiles on llama-13b's shapes (benchmarks/results/invariant-sweep-two-kernel-h100.json)
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8,         # within 1% of the best of 8
            "num_stages": 2 if wide else 3}


def _check(x: torch.Tensor, weight: torch.Tensor, parts: int) -> None:
    if parts not in SUPPORTED_PARTS:
        choices = ", ".join(map(str, SUPPORTED_PARTS[:-1]))
        raise ValueError(f"invariant_linear: parts must be {choices} or {SUPPORTED_PARTS[-1]}, got {parts}")
    if x.shape[-1] != weight.shape[1] or weight.shape[1] % parts:
        raise ValueError(f"invariant_linear: x [..., {x.shape[-1]}] @ weight {tuple(weight.shape)}^T with K cut "
                         f"into {parts} equal parts")


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int,
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (last dim contiguous); weight: [N, K] contiguous -> [M, N] in out_dtype (x's dtype). One part: one
    launch; more: one program per tile and part writes fp32 partials [parts, rows, N], a second kernel adds them,
    PARTIAL_ROWS rows at a time (rows are independent: the chunking changes no bits)."""
    _check(x, weight, parts)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    bias_arg = bias if bias is not None else weight
    if parts == 1:
        _launch_parts(x, weight, y, bias_arg, 1, bias is not None)
        return y
    for row in range(0, m, PARTIAL_ROWS):
        x_rows, y_rows = x[row:row + PARTIAL_ROWS], y[row:row + PARTIAL_ROWS]
        partials = torch.empty(parts, x_rows.shape[0], n, dtype=torch.float32, device=x.device)   # [parts, rows, N]
        _launch_parts(x_rows, weight, partials, bias_arg, parts, False)
        block = 1024
        _tree_kernel[(triton.cdiv(y_rows.numel(), block),)](partials, bias_arg, y_rows, y_rows.numel(), n,
                                                             partials.stride(0), PARTS=parts,
                                                             HAS_BIAS=bias is not None, BLOCK=block)
    return y


def _launch_parts(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor, parts: int,
                  has_bias: bool) -> None:
    """_part_kernel over x's rows: out is y [M, N] (one part) or the partials [parts, M, N]."""
    m, k = x.shape
    config = _tile_config(m, x.dtype)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(weight.shape[0], config["BLOCK_N"]), parts)
    _part_kernel[grid](x, weight, out, bias, m, weight.shape[0], k, x.stride(0), weight.stride(0), out.stride(-2),
                       out.stride(0) if parts > 1 else 0, PARTS=parts, HAS_BIAS=has_bias,
                       IEEE=x.dtype == torch.float32, **config)


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise: [a, b, c, d] -> (a + b) + (c + d); the order the kernel and ordered_all_reduce use."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _row_dots(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, k] @ w [N, k]^T in fp32 as products summed over k, a few columns at a time: each element's order of
    additions depends on k only. (torch's CPU matmul is not column-invariant: a column's bits change with N.)"""
    y = x.new_empty(x.shape[0], w.shape[0])
    step = max(1, (1 << 22) // max(1, x.shape[0] * x.shape[1]))          # columns per chunk: ~16 MiB of products
    for n0 in range(0, w.shape[0], step):
        y[:, n0:n0 + step] = (x[:, None, :] * w[None, n0:n0 + step, :]).sum(-1)      # [M, step, k] -> [M, step]
    return y


def invariant_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each K part's fp32 dot products (_row_dots), the parts added in tree_sum's order, then the bias; the
    result in out_dtype."""
    _check(x, weight, parts)
    x_parts = x.float().chunk(parts, dim=-1)
    w_parts = weight.float().chunk(parts, dim=-1)
    y = tree_sum([_row_dots(xp, wp) for xp, wp in zip(x_parts, w_parts, strict=True)])    # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: int = 1,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., K] @ [N, K]^T -> [..., N]: the Triton kernel on CUDA, the torch reference elsewhere."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x2) and weight.is_contiguous() and x2.stride(-1) == 1 and x2.shape[0] > 0:
        y = invariant_linear_triton(x2, weight, bias, parts, out_dtype)
    else:
        y = invariant_linear_ref(x2, weight, bias, parts, out_dtype)
    return y.reshape(*lead, weight.shape[0])
