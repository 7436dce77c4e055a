"""GPTQ (Frantar et al. 2022, arXiv:2210.17323) for int4 group-wise weights, in quantize_int4's layout
(formats.py), so kernels, saving and loading do not change.

For y = x W^T the squared output error of a rounded W is a quadratic form in the weight error, with Hessian
H = 2 X^T X over the calibration inputs X: [T, K]. GPTQ rounds W one input column at a time and spreads each
column's rounding error over the columns not yet rounded, along the inverse Hessian (the update that keeps the
output closest); lazy batches apply that update to the rest of the matrix once per block of columns. Then, with
the codes fixed, each row's scales and mins are refitted by least squares under H (_refit_grid).

quantize_model_gptq runs ONE prefill of calibration sequences through the model. A forward pre-hook on every
decoder-layer linear builds H from the input it receives, quantizes the weight and writes the dequantized
weight in place before the matmul runs, so every later linear (later sub-layers and layers) is calibrated on
the outputs of already quantized ones: the paper's sequential order. A fused projection (QKV, gate/up) gets one
input, so one Hessian serves the fused weight. After each decoder layer its linears become QuantLinears.

Calibration is data-free by default: sequences sampled from the dense model itself (temperature 1, each from a
uniformly random first token), so neither evaluation nor user text is needed; token ids of real text can be
passed instead."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from tierllm.config import QuantConfig
from tierllm.kernels import plan_prefill
from tierllm.layers.attention import AttentionMetadata
from tierllm.layers.quant_linear import QuantLinear
from tierllm.quant.formats import SCALE_DTYPE, dequantize_int4, pack_int4
from tierllm.quant.quantize import _fit_int4_grid, layer_linears
from tierllm.runner.kv_cache import allocate_kv_cache


@dataclass(frozen=True)
class GPTQOptions:
    num_sequences: int = 64            # data-free calibration: sequences sampled from the model ...
    seq_len: int = 128                 # ... of this many tokens each
    damp: float = 0.01                 # added to H's diagonal, as a share of its mean (keeps H invertible)
    act_order: bool = True             # columns of largest H diagonal first (groups stay static: same layout)
    refit: bool = True                 # refit the scales and mins to the final codes (least squares under H)
    block_size: int = 128              # columns per lazy batch update (rounded to whole groups)
    seed: int = 0                      # sampling of the calibration sequences


# ---- one weight ---------------------------------------------------------------------------------------------------
def _round_to_grid(w: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None):
    """w, scale, low: [N] (low None = symmetric) -> (codes in [0, 15], dequantized values) [N]."""
    if low is None:
        codes = torch.round(w / scale).clamp_(-8, 7)
        return codes + 8, codes * scale
    codes = torch.round((w - low) / scale).clamp_(0, 15)
    return codes, codes * scale + low


def _gptq_pass(w: torch.Tensor, h: torch.Tensor, perm: torch.Tensor, group_size: int, symmetric: bool,
               grid: tuple | None, block_size: int):
    """Round w [N, K] column by column in the order `perm`, compensating along H^-1 (h: [K, K], damped).
    grid: (scales, mins) [N, K // G] fitted in advance, or None to fit each group's grid when its first column
    comes (perm must then be the identity). -> (codes [N, K] in [0, 15] as floats, scales, mins)."""
    n, k = w.shape
    if grid is None:
        scales = w.new_empty(n, k // group_size)
        mins = None if symmetric else w.new_empty(n, k // group_size)
    else:
        scales, mins = grid
    w, h = w[:, perm], h[perm][:, perm]                                            # [N, K], [K, K] (copies)
    group_of = (perm // group_size).tolist()                                       # column (permuted) -> group
    # Upper Cholesky factor of H^-1: its row i holds the (scaled) update that column i's error sends to the
    # columns after it, once the columns before i are fixed (the paper's numerically stable form).
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)   # [K, K]
    codes = torch.empty_like(w)                                                    # permuted column order
    block = group_size * max(1, block_size // group_size)    # whole groups, so a group's columns share a block
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1].clone()                                                   # [N, B]
        errs = torch.empty_like(wb)                                                # [N, B]
        hb = hinv[b0:b1, b0:b1]                                                    # [B, B]
        for i in range(b1 - b0):
            g = group_of[b0 + i]
            if grid is None and (b0 + i) % group_size == 0:
                # fit the group's grid to its weights as they are now, earlier columns' errors included
                s, m, _ = _fit_int4_grid(wb[:, i:i + group_size].unsqueeze(1), symmetric)   # [N, 1]
                scales[:, g] = s[:, 0]
                if mins is not None:
                    mins[:, g] = m[:, 0]
            codes[:, b0 + i], q = _round_to_grid(wb[:, i], scales[:, g], None if mins is None else mins[:, g])
            errs[:, i] = (wb[:, i] - q) / hb[i, i]
            wb[:, i:] -= errs[:, i:i + 1] * hb[i:i + 1, i:]                        # compensate inside the block
        w[:, b1:] -= errs @ hinv[b0:b1, b1:]                                       # ... and, lazily, after it
    codes[:, perm] = codes.clone()                                                 # back to the original order
    return codes, scales, mins


def _output_error(w, h, codes, scales, mins, group_size: int) -> torch.Tensor:
    """Per row, (w - q) H (w - q)^T: the squared output error of the dequantized weight q. -> [N]"""
    n, k = w.shape
    grouped = codes.view(n, k // group_size, group_size)
    q = (grouped * scales[..., None] + (0 if mins is None else mins[..., None])).view(n, k)
    return (((w - q) @ h) * (w - q)).sum(-1)


def _refit_grid(w, h, codes, group_size: int, symmetric: bool, scales, mins, max_elements: int = 1 << 26):
    """With the codes fixed, a row's output error is quadratic in its groups' scales and mins: solve for them
    jointly (least squares under H; GPTQ's error feedback makes the grids fitted beforehand suboptimal) and keep
    the rows that improve (rounding to fp16 could undo a tiny gain).
    w [N, K], h [K, K], codes [N, K] in [0, 15], scales / mins [N, K // G] -> (scales, mins) with fp16 values."""
    n, k = w.shape
    ng = k // group_size
    levels = (codes - 8) if symmetric else codes                                  # q = level * scale (+ min)
    h_rows = h.view(ng, group_size, k)                                             # [G, Gs, K]
    min_min = h.view(ng, group_size, ng, group_size).sum((1, 3))                   # [G, G]
    new_scales, new_mins = torch.empty_like(scales), None if mins is None else torch.empty_like(mins)
    rows = max(1, max_elements // (ng * k))                                        # bounds the [R, G, K] temp
    for r0 in range(0, n, rows):
        c = levels[r0:r0 + rows].view(-1, ng, group_size)                          # [R, G, Gs]
        ch = torch.einsum("rai,aij->raj", c, h_rows).view(-1, ng, ng, group_size)  # [R, G, G, Gs]
        wh = (w[r0:r0 + rows] @ h).view(-1, ng, group_size)                        # [R, G, Gs]
        mat = torch.einsum("rabj,rbj->rab", ch, c)                                 # [R, G, G] scale x scale
        rhs = (c * wh).sum(-1)                                                     # [R, G]
        if mins is not None:
            scale_min = ch.sum(-1)                                                 # [R, G, G]
            mat = torch.cat((torch.cat((mat, scale_min), 2),
                             torch.cat((scale_min.transpose(1, 2), min_min.expand_as(scale_min)), 2)), 1)
            rhs = torch.cat((rhs, wh.sum(-1)), 1)                                  # [R, 2G]
        ridge = 1e-6 * mat.diagonal(dim1=1, dim2=2).mean(-1)      # a group of equal codes leaves mat singular
        eye = torch.eye(mat.shape[-1], device=mat.device)
        theta = torch.linalg.solve(mat + ridge[:, None, None] * eye, rhs[..., None])[..., 0]
        theta = theta.to(SCALE_DTYPE).float()                                      # the values stored
        new_scales[r0:r0 + rows] = theta[:, :ng]
        if mins is not None:
            new_mins[r0:r0 + rows] = theta[:, ng:]
    better = (_output_error(w, h, codes, new_scales, new_mins, group_size)
              < _output_error(w, h, codes, scales, mins, group_size))             # [N]; NaN / inf: not better
    scales = torch.where(better[:, None], new_scales, scales)
    return scales, None if mins is None else torch.where(better[:, None], new_mins, mins)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
                  damp: float = 0.01, act_order: bool = True, refit: bool = True,
                  block_size: int = 128) -> dict[str, torch.Tensor]:
    """weight [N, K], hessian [K, K] (X^T X of the calibration inputs, any positive scale) -> quantize_int4's
    tensors: {"qweight": uint8 [N, K // 2], "scales": fp16 [N, K // G] (+ "mins" fp16 when asymmetric)}.
    act_order: round the columns of largest H diagonal first, while many columns remain to absorb their
    errors. The groups stay contiguous in the original order (formats.py), so their grids are fitted upfront,
    on the original weights ("static groups"); without act_order each group's grid is fitted when its turn
    comes. refit: afterwards, refit every row's scales and mins to the final codes under H."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide in_features {k}: choose a group size "
                         "that divides every linear's input size (e.g. 32 or 64)")
    w = weight.float().clone()                                                     # [N, K]
    h = hessian.float().clone()                                                    # [K, K]
    dead = h.diagonal() == 0                           # inputs always 0: their weights never reach the output
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(damp * h.diagonal().mean())
    grid, perm = None, torch.arange(k, device=w.device)
    if act_order:
        grid = _fit_int4_grid(w.view(n, k // group_size, group_size), symmetric)[:2]
        perm = torch.argsort(h.diagonal(), descending=True)
    codes, scales, mins = _gptq_pass(w, h, perm, group_size, symmetric, grid, block_size)
    if refit:
        scales, mins = _refit_grid(w, h, codes, group_size, symmetric, scales, mins)
    out = {"qweight": pack_int4(codes.to(torch.uint8)), "scales": scales.to(SCALE_DTYPE)}
    if mins is not None:
        out["mins"] = mins.to(SCALE_DTYPE)
    return out


# ---- calibration passes -------------------------------------------------------------------------------------------
class _TemporaryKVCache:
    """Binds a KV cache for a calibration pass and restores the model's own (if any) afterwards. shared: layers
    of the same KV shape share one cache; that serves a single prefill from empty caches, as each layer writes
    all its keys and values before reading them and the next layer overwrites them."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype, device, shared: bool):
        self.model, self.layers = model, model.attention_layers()
        self.saved = [(layer.k_cache, layer.v_cache) for layer in self.layers]
        by_key: dict = {}
        self.caches = [by_key.setdefault((layer.num_kv_heads, layer.head_dim) if shared else id(layer),
                                         allocate_kv_cache([layer], num_blocks, block_size, dtype, device)[0])
                       for layer in self.layers]

    def __enter__(self):
        self.model.bind_kv_cache(self.caches)

    def __exit__(self, *exc):
        for layer, (k_cache, v_cache) in zip(self.layers, self.saved, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache


def _model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    embedding = next(p for p in model.parameters() if p.is_floating_point())
    return embedding.dtype, embedding.device


@torch.inference_mode()
def sample_calibration(model: nn.Module, num_sequences: int, seq_len: int, seed: int = 0,
                       show_progress: bool = False, block_size: int = 16) -> list[list[int]]:
    """Data-free calibration: `num_sequences` sequences of `seq_len` tokens sampled from the (dense) model
    itself at temperature 1, each from a uniformly random first token, decoded together as one batch."""
    dtype, device = _model_dtype_device(model)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-seq_len // block_size)
    ids = torch.randint(0, model.config.vocab_size, (num_sequences,), generator=gen)    # [S]
    rows = torch.arange(num_sequences, device=device)
    tables = rows[:, None] * blocks_per_seq + torch.arange(blocks_per_seq, device=device)   # [S, blocks]
    tokens = [ids]
    with _TemporaryKVCache(model, num_sequences * blocks_per_seq, block_size, dtype, device, shared=False):
        for pos in tqdm(range(seq_len - 1), desc="GPTQ calibration (sampling)", unit="token",
                        disable=not show_progress, leave=False):      # one decode token per sequence and step
            meta = AttentionMetadata(
                slot_mapping=rows * blocks_per_seq * block_size + pos, num_decode_tokens=num_sequences,
                decode_block_tables=tables[:, :pos // block_size + 1].contiguous(),   # blocks of positions <= pos
                decode_context_lens=torch.full((num_sequences,), pos + 1, device=device),
                prefill_block_tables=torch.zeros(0, 0, dtype=torch.int64, device=device),
                prefill_query_lens=[], prefill_context_lens=[])
            hidden = model(ids.to(device), torch.full((num_sequences,), pos, device=device), meta)
            probs = torch.softmax(model.compute_logits(hidden).float(), dim=-1).cpu()    # [S, vocab]
            ids = torch.multinomial(probs, 1, generator=gen)[:, 0]
            tokens.append(ids)
    return torch.stack(tokens, dim=1).tolist()                                        # [S][L]


def calibration_from_ids(token_ids: list[int], options: GPTQOptions = GPTQOptions()) -> list[list[int]]:
    """User calibration text (token ids) -> up to options.num_sequences sequences of options.seq_len tokens."""
    n = options.seq_len
    sequences = [token_ids[i:i + n] for i in range(0, len(token_ids), n)][:options.num_sequences]
    if not sequences or len(sequences[0]) < 2:
        raise ValueError("the calibration text is too short: give GPTQ at least a few hundred tokens of text")
    return sequences


def _prefill_meta(lengths: list[int], block_size: int, device) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """One prefill step of several sequences from empty caches -> (metadata, positions [T], blocks needed)."""
    max_blocks = -(-max(lengths) // block_size)
    slots = [s * max_blocks * block_size + torch.arange(n) for s, n in enumerate(lengths)]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device), num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
        prefill_block_tables=torch.arange(len(lengths) * max_blocks, device=device).view(len(lengths), max_blocks),
        prefill_query_lens=list(lengths), prefill_context_lens=list(lengths))
    if device.type == "cuda":
        meta.prefill_plan = plan_prefill(meta.prefill_query_lens, meta.prefill_context_lens, device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    return meta, positions, len(lengths) * max_blocks


@torch.no_grad()
def quantize_model_gptq(model: nn.Module, quant: QuantConfig, calibration: list[list[int]] | None = None,
                        options: GPTQOptions = GPTQOptions(), show_progress: bool = True,
                        max_len: int | None = None) -> nn.Module:
    """Replace every decoder-layer linear with a GPTQ-quantized QuantLinear, in place (see the module doc).
    calibration: token-id sequences to calibrate on (default: options.num_sequences x options.seq_len tokens
    sampled from the model), all run as one prefill; max_len: positions the model was built for (longer
    sequences are cut). Needs the whole model on one device (no tensor parallelism)."""
    if quant.bits != 4 or quant.activations is not None:
        raise ValueError(f"GPTQ quantizes int4 weights, not {quant.name}")
    layers = model.decoder_layers()
    linears = [linear for layer in layers for _, _, linear in layer_linears(layer)]
    if any(getattr(linear.parallel, "tp_size", 1) > 1 for linear in linears):
        raise ValueError("method='gptq' does not support tensor parallelism: use method='rtn' with "
                         "tensor_parallel, or quantize on one device")
    if calibration is None:
        seq_len = min(options.seq_len, max_len or options.seq_len)
        calibration = sample_calibration(model, options.num_sequences, seq_len, options.seed, show_progress)
    calibration = [list(seq)[:max_len] for seq in calibration if len(seq) > 0]
    if not calibration:
        raise ValueError("GPTQ needs at least one non-empty calibration sequence")
    dtype, device = _model_dtype_device(model)
    packed: dict[int, dict[str, torch.Tensor]] = {}

    def quantize_on_input(linear, args):
        x = args[0].reshape(-1, linear.in_features).float()                            # [T, K]
        hessian = x.T @ x * (2 / x.shape[0])                                           # [K, K]
        tensors = gptq_quantize(linear.weight, hessian, quant.group_size, quant.symmetric, options.damp,
                                options.act_order, options.refit, options.block_size)
        # the rest of this pass (later linears and layers) runs on the quantized weight
        linear.weight.copy_(dequantize_int4(tensors["qweight"], tensors["scales"], tensors.get("mins"),
                                            quant.group_size, linear.weight.dtype))
        packed[id(linear)] = tensors

    bar = tqdm(total=len(layers), desc=f"GPTQ ({quant.name})", unit="layer", disable=not show_progress, leave=False)

    def replace_linears(layer, args, output):
        for parent, attr, linear in layer_linears(layer):
            if id(linear) not in packed:
                raise RuntimeError(f"GPTQ: linear {attr!r} of {type(layer).__name__} received no calibration input")
            qlinear = QuantLinear.like(linear, quant)
            qlinear.load_quantized(packed.pop(id(linear)), linear.bias)
            setattr(parent, attr, qlinear)                                  # frees the dense weight
        bar.update(1)

    hooks = [linear.register_forward_pre_hook(quantize_on_input) for linear in linears]
    hooks += [layer.register_forward_hook(replace_linears) for layer in layers]
    block_size = 16
    meta, positions, num_blocks = _prefill_meta([len(s) for s in calibration], block_size, device)
    ids = torch.tensor([t for seq in calibration for t in seq], dtype=torch.int64, device=device)
    try:
        with _TemporaryKVCache(model, num_blocks, block_size, dtype, device, shared=True):
            model(ids, positions, meta)
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    return model
