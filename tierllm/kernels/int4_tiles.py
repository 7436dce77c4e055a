"""int4 weights repacked in tiles of 16 rows for the tensor-core decode kernels (`mma.sync.m16n8k16` on the codes at
batch 1; the Gluon probes in benchmarks/int4_mma_*_probe.py, benchmarks/notes/gpu-decode.md sessions 49-52), from
quant/formats.py's int4 (codes uint8 [N, K / 2], fp16 scales and mins [N, K / 64]).

A lane l = 4 gid + t of a warp turns each int32 word of 8 codes into four fp16 pairs with one shift and four LOP3s
(code | 1024.0's bits: 1024 + code, or 1024 + 16 code for the odd nibbles, exact), and the MMA sums them against x,
whose 8 columns are all the same x (batch 1), so every lane ends with its rows' dots. Per (row, group) then:
scale * (C - X1) + min * X0, with X1 = 1024 * sum(x / m) the bias of the 1024s and X0 = sum(x), both per group.

Layout:
- codes int32 [N / 16, G, 128]: per (tile, group) 512 bytes, lane l holding [row gid: words 2t, 2t + 1; row gid + 8:
  words 2t, 2t + 1] of the group, so that a lane's four words are one conflict-free 16-byte shared-memory read;
- pairs int32 [N / 16, G, 16]: per (tile, group) the (scale, min) pairs as [gid][row gid, row gid + 8], each the
  scale's fp16 bits low and the min's high;
- x per group as each lane t's eight fp16 pairs (B fragments): pair 4h + j = (x[8w + j], x[8w + j + 4]) / m_j for
  word w = 2t + h, m_j = 16 for odd j; and (X0, X1, 0, 0) per group. The MMA's k order within a group is thereby:
  mma s (h = s // 2, j = 2 (s % 2) + half) takes nibbles j and j + 4 of words 2t + h.

The decode kernels also store some projections' rows in their own order: qkv head by head (head_major_rows: each
head's q, k and v rows together, so that a head's sums are counted as one), gate/up in tiles of 8 gate rows and the
same channels' 8 up rows (interleaved_rows: a tile's rows gid and gid + 8 are one channel's gate and up).
"""
from __future__ import annotations

import torch

GROUP = 64
TILE = 16                        # weight rows per MMA tile
MAGIC = 1024.0                   # the fp16 whose bits a code is ORed into (its last mantissa unit is 1)
CG = 4                           # groups a lane computes at once from a slot (its registers)


def scale_min_pairs(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """fp16 [N, G] scales and mins -> int32 [N, G]: the scale's bits low, the min's high."""
    return (scales.view(torch.int16).int() & 0xFFFF) | (mins.view(torch.int16).int() << 16)


def repacked(w: dict) -> dict:
    """One weight (quant/formats.py's int4: codes uint8 [N, K / 2], fp16 scales and mins [N, G]) in the tile layout:
    codes int32 [N / 16, G, 128] and (scale, min) pairs int32 [N / 16, G, 16] (module docstring)."""
    n, groups = w["scales"].shape
    words = w["qweight"].view(torch.int32).view(n // TILE, 2, 8, groups, 4, 2)       # tile, half, gid, g, t, h
    pairs = scale_min_pairs(w["scales"], w["mins"]).view(n // TILE, 2, 8, groups)
    return {"codes": words.permute(0, 3, 2, 4, 1, 5).contiguous().view(n // TILE, groups, 128),
            "pairs": pairs.permute(0, 3, 2, 1).contiguous().view(n // TILE, groups, 16)}


def head_major_rows(heads: int, head_dim: int) -> torch.Tensor:
    """qkv's stored row order: head h's q rows, then its k rows, then its v rows ([q; k; v] as the engine stacks
    them, heads * head_dim rows each)."""
    rows = heads * head_dim
    within = torch.arange(head_dim)
    return torch.cat([torch.cat([part * rows + h * head_dim + within for part in range(3)]) for h in range(heads)])


def interleaved_rows(n_half: int, half: int) -> torch.Tensor:
    """The stored row order the kernels read gate/up in: blocks of `half` gate rows, then the same channels' up rows
    (gate is rows 0 .. n_half - 1 of [gate; up], up the rest)."""
    channel = torch.arange(n_half).view(-1, half)
    return torch.stack([channel, channel + n_half], dim=1).reshape(-1)


def _rows(w: dict, order: torch.Tensor) -> dict:
    """w's codes, scales and mins with their rows in `order`."""
    order = order.to(w["qweight"].device)
    return {key: w[key][order] for key in ("qweight", "scales", "mins")}


def stored_qkv(w: dict, heads: int, head_dim: int) -> dict:
    """One stacked [q; k; v; ..] weight's qkv rows, head by head (head_major_rows), repacked."""
    return repacked(_rows(w, head_major_rows(heads, head_dim)))


def stored_o(w: dict, heads: int, head_dim: int) -> dict:
    """One stacked [q; k; v; o] weight's o rows, repacked."""
    return repacked(_rows(w, torch.arange(3 * heads * head_dim, 4 * heads * head_dim)))


def stored_gate_up(w: dict, inter: int) -> dict:
    """One gate/up weight (rows [gate; up], inter channels) repacked with its rows in tiles of 8 gate rows then the
    same channels' up rows (interleaved_rows): channel c's gate sum lands at gate_row(c), its up sum 8 rows further."""
    return repacked(_rows(w, interleaved_rows(inter, TILE // 2)))


def gate_row(channel: torch.Tensor) -> torch.Tensor:
    """The stored row of a channel's gate (stored_gate_up's order)."""
    return channel // 8 * 16 + channel % 8


def x_fragments(x: torch.Tensor) -> dict:
    """x (any float [K]) as the kernels take it: per group lane t's eight fp16 pairs, pair 4h + j = (x[8w + j],
    x[8w + j + 4]) / m_j for word w = 2t + h (m_j = 16 for odd j), int32 [G, 32]; and per group (X0, X1, 0, 0) fp32
    [G, 4], X0 = sum(x) and X1 = 1024 * sum of the fp16 values (the 1024s' bias in the MMA's sums)."""
    groups = x.numel() // GROUP
    m = torch.tensor([1.0, 16.0, 1.0, 16.0], device=x.device)
    halves = (x.float().view(groups, 8, 2, 4) / m).half()                           # [g, w, e, j]
    bits = halves.view(torch.int16).int() & 0xFFFF
    frags = (bits[:, :, 0] | (bits[:, :, 1] << 16)).contiguous().view(groups, 32)    # [g, w = 2t + h, j]
    sums = torch.zeros(groups, 4, device=x.device, dtype=torch.float32)
    sums[:, 0] = x.float().view(groups, GROUP).sum(1)
    sums[:, 1] = MAGIC * halves.float().view(groups, GROUP).sum(1)
    return {"frags": frags, "sums": sums}


def emulated(codes: torch.Tensor, pairs: torch.Tensor, frags: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in torch (fp32): per (tile, group, lane) the registers their PTX builds (1024 + m_j *
    nibble) times x's B pairs, summed as the MMAs sum them, then scale * (C - X1) + min * X0; y [N]. The reference
    for the layouts on CPU (the MMA's register order itself is checked on a GPU)."""
    tiles, groups, _ = codes.shape
    words = codes.view(tiles, groups, 8, 4, 2, 2).long() & 0xFFFFFFFF                # tile, g, gid, t, half, h
    j = torch.arange(4, device=codes.device).view(4, 1)
    e = torch.arange(2, device=codes.device).view(1, 2)
    nibbles = (words[..., None, None] >> (4 * (j + 4 * e))) & 0xF                     # [..., half, h, j, e]
    m = torch.tensor([1.0, 16.0, 1.0, 16.0], device=codes.device).view(4, 1)
    a = MAGIC + m * nibbles.float()
    b_bits = frags.view(groups, 4, 2, 4).long() & 0xFFFFFFFF                          # g, t, h, j
    b = torch.stack([(b_bits >> (16 * k)) & 0xFFFF for k in range(2)], -1)           # [g, t, h, j, e]
    b = b.to(torch.int16).view(torch.float16).float()
    c = torch.einsum("xgdtrhje,gthje->xgrd", a, b)                                    # [tile, g, half, gid]
    p = pairs.view(tiles, groups, 8, 2).permute(0, 1, 3, 2).long() & 0xFFFFFFFF        # [tile, g, half, gid]
    scale = (p & 0xFFFF).to(torch.int16).view(torch.float16).float()
    low = (p >> 16).to(torch.int16).view(torch.float16).float()
    y = scale * (c - sums[None, :, 1, None, None]) + low * sums[None, :, 0, None, None]
    return y.sum(1).reshape(tiles * TILE)
