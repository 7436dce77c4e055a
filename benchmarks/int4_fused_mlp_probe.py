"""An int4 MLP in one kernel for batch-1 decode, against the engine's two GEMVs (issue #5's batch-1 target).

The engine runs a llama MLP at one token as gate/up (the RMSNorm inside, gated) -> its x-preparing kernel -> down
(the residual added), each waiting for the one before. down is its least efficient GEMV: on an H200 it took ~10 us
for 5.3 us of codes at the copy rate, x's loads and the kernel boundary among the costs
(benchmarks/notes/gpu-decode.md).

Here each program owns CHUNK rows of the intermediate activation. It computes them from gate's and up's rows (the
norm's rstd applied at the end, as the XHALF GEMVs do), then multiplies them straight into down's CHUNK columns,
writing a partial sum per hidden unit; a second kernel adds the partials into the residual. down's x never leaves the
program, and its weight streams while gate/up's does, with no kernel boundary between them. down is repacked for it
(repack_down): its codes chunk-major [I / CHUNK, H, CHUNK / 8] int32 words, so that a program reads one contiguous
block, and its scales and mins transposed [I / 64, H].

Timed: each form chained COPIES times in a CUDA graph over weight copies that miss L2, launched with PDL where the GPU
has it, us per MLP; the engine's at its graph-tuner picks (tuned here if the tuning file lacks them).

    python benchmarks/int4_fused_mlp_probe.py [--out PATH] [--configs CHUNK:STEP_GROUPS:BLOCK_H:WARPS,...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, probe_parser, random_int4_copies  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait, pdl_options  # noqa: E402

GROUP = 64
WORD_CODES = 8                       # int4 codes per int32 word: code j of word w is (w >> 4j) & 15, k = 8w + j
COPIES = 8
HIDDEN, INTERMEDIATE = 4096, 11008   # llama-7b
CONFIGS = [(16, 4, 256, 4), (16, 8, 256, 4), (32, 2, 256, 4), (32, 4, 256, 4), (32, 8, 256, 8), (64, 8, 256, 8)]


@triton.jit
def _fused_mlp_kernel(h_ptr, gamma_ptr, w_ptr, s_ptr, mn_ptr, dw_ptr, ds_ptr, dm_ptr, part_ptr, K, INTER, H, eps,
                      CHUNK: tl.constexpr, STEP_GROUPS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    p = tl.program_id(0)
    WORDS: tl.constexpr = CHUNK // 8
    rows = p * CHUNK + tl.arange(0, CHUNK)                                    # [C] gate rows; up's at I + rows
    groups = tl.arange(0, STEP_GROUPS)                                        # [G]
    group_words = tl.arange(0, 8)                                             # [8] words of one group
    k_words = K // 8
    # [C, G, 8] word offsets of a step's first group in gate's rows, and [G, 8] of x (its first code)
    w_offs = rows[:, None, None] * k_words + groups[None, :, None] * 8 + group_words[None, None, :]
    up_offs = w_offs + INTER * k_words
    x_offs = (groups[:, None] * 8 + group_words[None, :]) * 8
    sc_offs = rows[:, None] * (K // 64) + groups[None, :]                     # [C, G]
    hs = tl.arange(0, BLOCK_H)
    d_offs = (p * H + hs)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]     # [BH, W] down's first block

    # the weights do not depend on the kernel before: their first loads go out before the PDL wait
    gate = tl.load(w_ptr + w_offs)
    up = tl.load(w_ptr + up_offs)
    down = tl.load(dw_ptr + d_offs, mask=(hs < H)[:, None], other=0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

    acc_g = tl.zeros([CHUNK], tl.float32)
    acc_u = tl.zeros([CHUNK], tl.float32)
    sumsq = tl.zeros([STEP_GROUPS, 8], tl.float32)
    steps = K // (64 * STEP_GROUPS)
    for step in range(steps):
        words = step * STEP_GROUPS * 8
        nxt = tl.minimum(step + 1, steps - 1) * STEP_GROUPS * 8               # the last step loads itself again
        next_gate = tl.load(w_ptr + w_offs + nxt)
        next_up = tl.load(w_ptr + up_offs + nxt)
        s_g = tl.load(s_ptr + sc_offs + step * STEP_GROUPS).to(tl.float32)
        mn_g = tl.load(mn_ptr + sc_offs + step * STEP_GROUPS).to(tl.float32)
        s_u = tl.load(s_ptr + sc_offs + INTER * (K // 64) + step * STEP_GROUPS).to(tl.float32)
        mn_u = tl.load(mn_ptr + sc_offs + INTER * (K // 64) + step * STEP_GROUPS).to(tl.float32)
        dot_g = tl.zeros([CHUNK, STEP_GROUPS, 8], tl.float32)
        dot_u = tl.zeros([CHUNK, STEP_GROUPS, 8], tl.float32)
        x_sum = tl.zeros([STEP_GROUPS, 8], tl.float32)
        for j in tl.static_range(8):
            k = words * 8 + x_offs + j                                        # [G, 8]
            x = tl.load(h_ptr + k).to(tl.float32)
            sumsq += x * x
            xg = x * tl.load(gamma_ptr + k).to(tl.float32)
            x_sum += xg
            dot_g += ((gate >> (4 * j)) & 15).to(tl.float32) * xg[None, :, :]
            dot_u += ((up >> (4 * j)) & 15).to(tl.float32) * xg[None, :, :]
        group_x = tl.sum(x_sum, axis=1)                                       # [G]
        acc_g += tl.sum(s_g * tl.sum(dot_g, axis=2) + mn_g * group_x[None, :], axis=1)
        acc_u += tl.sum(s_u * tl.sum(dot_u, axis=2) + mn_u * group_x[None, :], axis=1)
        gate, up = next_gate, next_up

    rstd = tl.rsqrt(tl.sum(tl.sum(sumsq, axis=1), axis=0) / K + eps)
    g, u = acc_g * rstd, acc_u * rstd
    act = (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16).to(tl.float32)        # [C], rounded as the GEMV's output
    act_words = tl.reshape(act, (WORDS, 8))                                   # [W, 8]: act[8w + j]
    lanes = tl.arange(0, 8)[None, :]
    act_sum = tl.sum(act, axis=0)
    group = (p * CHUNK) // 64

    for block in range(0, tl.cdiv(H, BLOCK_H)):
        h_rows = block * BLOCK_H + hs
        h_mask = h_rows < H
        nxt = tl.minimum(block + 1, tl.cdiv(H, BLOCK_H) - 1) * BLOCK_H * WORDS
        next_down = tl.load(dw_ptr + d_offs + nxt, mask=((tl.minimum(block + 1, tl.cdiv(H, BLOCK_H) - 1)
                                                         * BLOCK_H + hs) < H)[:, None], other=0)
        dot = tl.zeros([BLOCK_H, WORDS], tl.float32)
        for j in tl.static_range(8):
            plane = tl.sum(tl.where(lanes == j, act_words, 0.0), axis=1)      # [W]: act[8w + j]
            dot += ((down >> (4 * j)) & 15).to(tl.float32) * plane[None, :]
        scale = tl.load(ds_ptr + group * H + h_rows, mask=h_mask, other=0.0).to(tl.float32)
        low = tl.load(dm_ptr + group * H + h_rows, mask=h_mask, other=0.0).to(tl.float32)
        tl.store(part_ptr + p * H + h_rows, scale * tl.sum(dot, axis=1) + low * act_sum, mask=h_mask)
        down = next_down


@triton.jit
def _partials_into_residual_kernel(part_ptr, h_ptr, P, H, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
                                   PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, P, BLOCK_P):
        ps = start + tl.arange(0, BLOCK_P)
        tile = tl.load(part_ptr + ps[:, None] * H + hs[None, :], mask=(ps < P)[:, None] & h_mask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    h = tl.load(h_ptr + hs, mask=h_mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + hs, (h + acc).to(tl.bfloat16), mask=h_mask)


def repack_down(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, chunk: int) -> dict:
    """down_proj's int4 weight (quant/formats.py: [H, I // 2] codes, [H, I // 64] scales and mins) as the fused
    kernel reads it: words [I / chunk, H, chunk / 8] int32, scales and mins [I / 64, H]."""
    h, half_i = qweight.shape
    words = qweight.contiguous().view(torch.int32).view(h, 2 * half_i // chunk, chunk // WORD_CODES)
    return {"words": words.permute(1, 0, 2).contiguous(), "scales": scales.t().contiguous(),
            "mins": mins.t().contiguous()}


def fused_mlp(h: torch.Tensor, gamma: torch.Tensor, gate_up: dict, down: dict, partials: torch.Tensor,
              chunk: int = 32, step_groups: int = 8, block_h: int = 256, warps: int = 8, eps: float = 1e-5,
              pdl: bool = False) -> torch.Tensor:
    """h: bf16 [1, H] (the residual stream, updated in place and returned); gamma: [H] the norm's weight; gate_up: the
    gated int4 weight ([gate; up], [2I, H // 2] codes, group 64, asymmetric); down: repack_down(down_proj, chunk);
    partials: fp32 [I / chunk, H] scratch. h += down(silu(gate(norm(h))) * up(norm(h)))."""
    hidden = h.shape[-1]
    inter = gate_up["qweight"].shape[0] // 2
    if inter % chunk or hidden % (GROUP * step_groups) or chunk % WORD_CODES or GROUP % chunk:      # one group each
        raise ValueError(f"fused_mlp: chunk {chunk} and step {step_groups} groups do not tile H={hidden}, I={inter}")
    programs = inter // chunk
    gate_words = gate_up["qweight"].view(torch.int32)
    _fused_mlp_kernel[(programs,)](h, gamma, gate_words, gate_up["scales"], gate_up["mins"], down["words"],
                                   down["scales"], down["mins"], partials, hidden, inter, hidden, eps,
                                   CHUNK=chunk, STEP_GROUPS=step_groups, BLOCK_H=block_h, num_warps=warps,
                                   **pdl_options(h, pdl))
    _partials_into_residual_kernel[(triton.cdiv(hidden, 64),)](partials, h, programs, hidden, BLOCK_P=64, BLOCK_H=64,
                                                               num_warps=4, **pdl_options(h, pdl))
    return h


def mlp_ref(h: torch.Tensor, gamma: torch.Tensor, gate_up: dict, down: dict, eps: float = 1e-5,
            rounded: bool = True) -> torch.Tensor:
    """The MLP step as the engine's GEMVs define it (quant_gemv.w4_fused_ref: fp32 math, the norm unrounded, the
    activation in bf16): the new residual, in bf16 (rounded) or fp32."""
    from tierllm.kernels.quant_gemv import w4_fused_ref

    act = w4_fused_ref(h, gate_up["qweight"], gate_up["scales"], gate_up["mins"], GROUP, norm_weight=gamma, eps=eps,
                       gated=True)                                                 # [1, I] bf16
    new = w4_fused_ref(act.float(), down["qweight"], down["scales"], down["mins"], GROUP, residual=h.float())
    return new.bfloat16() if rounded else new


def update_error(new: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> float:
    """The MLP's output (new - old) against the reference's, relative."""
    delta, ref_delta = new.float() - old.float(), ref.float() - old.float()
    return float(((delta - ref_delta).norm() / ref_delta.norm()).item())


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-fused-mlp-probe-h200.json")
    parser.add_argument("--configs", default=None, help="CHUNK:STEP_GROUPS:BLOCK_H:WARPS, comma-separated")
    args = parser.parse_args(argv)
    configs = CONFIGS if args.configs is None else [tuple(map(int, c.split(":"))) for c in args.configs.split(",")]
    if lacks_cuda():
        return 2
    from tierllm.kernels.quant_gemv import w4_gemv_triton

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_ups = random_int4_copies(2 * INTERMEDIATE, HIDDEN, COPIES, gen, GROUP, min_jitter=0.3)
    downs = random_int4_copies(HIDDEN, INTERMEDIATE, COPIES, gen, GROUP, min_jitter=0.3)
    h0 = torch.randn(1, HIDDEN, device="cuda", generator=gen).bfloat16()
    gamma = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16()
    ref = mlp_ref(h0, gamma, gate_ups[0], downs[0])
    weight_bytes = sum(t.nbytes for t in (*gate_ups[0].values(), *downs[0].values()))
    result = {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "weight_bytes": weight_bytes,
              "floor_us": round(weight_bytes / (copy_GBps * 1e9) * 1e6, 2), "copy_GBps": round(copy_GBps, 1),
              "us": {}, "update_rel_err": {}}

    def timed(run, pairs: list) -> tuple[float, float]:
        """(us per MLP with run(pair, h) chained over pairs in a graph, the update error of one run from h0)."""
        h = h0.clone()
        run(pairs[0], h)                                  # compiles (and tunes the engine's GEMVs) before capture
        error = update_error(h, ref, h0)
        h = h0.clone()
        return round(chained_us(lambda pair: run(pair, h), pairs), 2), error

    def engine(pair: tuple, h: torch.Tensor) -> None:
        gu, dn = pair
        act = w4_gemv_triton(h, gu["qweight"], gu["scales"], gu["mins"], GROUP, norm_weight=gamma, eps=1e-5,
                             gated=True, pdl=True)
        w4_gemv_triton(act, dn["qweight"], dn["scales"], dn["mins"], GROUP, residual=h, pdl=True)

    label = "engine"
    result["us"][label], result["update_rel_err"][label] = timed(engine, list(zip(gate_ups, downs, strict=True)))
    print(f"engine (gate/up, prepare, down): {result['us'][label]} us, floor {result['floor_us']} us, "
          f"update error {result['update_rel_err'][label]:.2e}", flush=True)

    for chunk, step_groups, block_h, warps in configs:
        label = f"chunk{chunk} step{step_groups} bh{block_h} w{warps}"
        packed = [repack_down(d["qweight"], d["scales"], d["mins"], chunk) for d in downs]
        partials = torch.empty(INTERMEDIATE // chunk, HIDDEN, device="cuda", dtype=torch.float32)
        shape = {"chunk": chunk, "step_groups": step_groups, "block_h": block_h, "warps": warps}

        def fused(pair: tuple, h: torch.Tensor, partials=partials, shape=shape) -> None:
            fused_mlp(h, gamma, pair[0], pair[1], partials, **shape, pdl=True)
        try:
            result["us"][label], result["update_rel_err"][label] = timed(
                fused, list(zip(gate_ups, packed, strict=True)))
            print(f"{label}: {result['us'][label]} us, update error {result['update_rel_err'][label]:.2e}", flush=True)
        except Exception as error:                          # a config the compiler refuses: say so, go on
            result["us"][label] = f"{type(error).__name__}: {error}"[:300]
            print(f"{label}: {result['us'][label]}", flush=True)
        del packed, partials
    result["over_engine"] = over(result["us"], result["us"]["engine"])
    result["over_floor"] = over(result["us"], result["floor_us"])
    write_result(args.out, "int4-fused-mlp-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": result["copy_GBps"]},
                 {"note": "none: a diagnostic of our own kernels; the baseline is the engine's int4 MLP (its graph "
                          "tuner's picks) in the same run"},
                 result, [], {"copies": COPIES, "group": GROUP, "pdl": True, "configs": [list(c) for c in configs]})
    print(f"wrote {args.out}")
    return 0


def over(times: dict, base: float) -> dict:
    """Each timed entry of `times` (us; failed configs hold their error) over `base`."""
    return {label: round(us / base, 3) for label, us in times.items() if isinstance(us, float)}


if __name__ == "__main__":
    raise SystemExit(main())
