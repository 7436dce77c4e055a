"""What a batch-1 int4 GEMV on int8 activations (W4A8, DP4A) would cost, against the XHALF GEMV that decode runs:
a probe for issue #5's batch-1 target, not an engine path.

XHALF (quant_gemv._half_dot) spends, per 16-byte chunk of weight, four 16-byte loads of x's fp16 planes and about
two instructions per two codes (benchmarks/notes/gpu-decode.md, twenty-eighth session: x's loads and the math are
where its time over a plain read goes). Here x is int8, quantized per run of 32 k (one fp32 scale per run, as W8A8's
activations are per token), two 4-byte words of x per weight word, and a word's 8 codes take one shift, two ANDs and
two DP4A (`dp4a.u32.s32`: four unsigned codes times four signed x bytes, summed into an int32). Per run the int32 sum
times (x's scale * the group's scale), plus the group's min times the run's sum of x.

On llama-7b's four shapes (group 64, asymmetric, random codes; COPIES weight copies so nothing stays in L2), each
launch chained in a CUDA graph with PDL: microseconds per launch of the DP4A loop at a few tile shapes, against the
XHALF GEMV (w4_gemv_triton at the graph tuner's pick, its preparing kernel included) timed the same way, and the
results against the dequantized weight times the int8-rounded x (fp32; the DP4A sums are exact).

    python benchmarks/w4a8_dp4a_probe.py [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import graph_us, lacks_cuda, probe_parser, random_int4_copies  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait  # noqa: E402

GROUP, RUN = 64, 32
COPIES = 16
SHAPES = {"o": (4096, 4096), "qkv": (12288, 4096), "down": (4096, 11008), "gate_up": (22016, 4096)}
TILES = [(4, 32, 8), (8, 16, 8), (2, 64, 8), (4, 16, 4), (2, 32, 4), (8, 32, 8)]     # (rows, groups per step, warps)

_DP4A = tl.constexpr("dp4a.u32.s32 $0, $1, $2, $3;")


@triton.jit
def _dp4a(codes, x, acc):
    return tl.inline_asm_elementwise(_DP4A, "=r,r,r,r", [codes, x, acc], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _w4a8_kernel(w_ptr, xe_ptr, xo_ptr, xs_ptr, xsum_ptr, s_ptr, m_ptr, y_ptr, KW: tl.constexpr,
                 ROWS: tl.constexpr, GPB: tl.constexpr):
    """Program p: y[rows p * ROWS ..] = the rows' int4 codes (int32 words, 8 per word, KW words per row; groups of 8
    words) . x, x as int8 words of the even and odd k of each weight word (xe, xo), one scale and one sum per run of
    4 words. Tiles [ROWS, GPB groups, 8 words], as quant_gemv's XHALF loop lays out its weight words, so that the
    per-run and per-group factors broadcast without layout conversions."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    groups = tl.arange(0, GPB)
    words = groups[:, None] * 8 + tl.arange(0, 8)[None, :]                                # [GPB, 8]
    runs = groups[:, None] * 2 + tl.arange(0, 2)[None, :]                                 # [GPB, 2]
    NUM_GROUPS: tl.constexpr = KW // 8
    acc = tl.zeros([ROWS, GPB, 2], tl.float32)
    gdc_launch_dependents()
    w_at = w_ptr + rows[:, None, None] * KW + words[None]
    w = tl.load(w_at, mask=(groups < NUM_GROUPS)[None, :, None], other=0)
    gdc_wait()
    for g0 in range(0, NUM_GROUPS, GPB):
        if g0 > 0:
            w = tl.load(w_at + g0 * 8, mask=(g0 + groups < NUM_GROUPS)[None, :, None], other=0)
        ok = (g0 + groups < NUM_GROUPS)[None, :, None] & (rows >= 0)[:, None, None]
        x_at = g0 * 8 + words[None] + 0 * rows[:, None, None]                            # [ROWS, GPB, 8]
        xe = tl.load(xe_ptr + x_at, mask=ok, other=0)
        xo = tl.load(xo_ptr + x_at, mask=ok, other=0)
        dots = _dp4a((w >> 4) & 0x0F0F0F0F, xo, _dp4a(w & 0x0F0F0F0F, xe, tl.zeros_like(w)))
        run_dots = tl.sum(tl.reshape(dots, [ROWS, GPB, 2, 4]), axis=3)                   # [ROWS, GPB, 2] int32
        run_ok = (g0 + groups < NUM_GROUPS)[:, None]
        xs = tl.load(xs_ptr + g0 * 2 + runs, mask=run_ok, other=0.0)[None]               # [1, GPB, 2]
        xsum = tl.load(xsum_ptr + g0 * 2 + runs, mask=run_ok, other=0.0)[None]
        at = rows[:, None] * NUM_GROUPS + g0 + groups[None, :]                           # [ROWS, GPB]
        scale = tl.load(s_ptr + at, mask=(g0 + groups < NUM_GROUPS)[None, :], other=0.0).to(tl.float32)[:, :, None]
        low = tl.load(m_ptr + at, mask=(g0 + groups < NUM_GROUPS)[None, :], other=0.0).to(tl.float32)[:, :, None]
        acc += run_dots.to(tl.float32) * (xs * scale) + xsum * low
    tl.store(y_ptr + rows, tl.sum(tl.sum(acc, axis=2), axis=1).to(y_ptr.dtype.element_ty))


def quantize_x(x: torch.Tensor) -> dict:
    """x [K] -> int8 per run of 32 (absmax), as the kernel reads it: the even and odd k of each 8 as int32 words,
    the runs' scales and sums (of the int8-rounded x), and the rounded x itself (fp32) for the reference."""
    k = x.numel()
    runs = x.float().view(k // RUN, RUN)
    scale = runs.abs().amax(dim=1).clamp(min=1e-20) / 127                              # [K / 32]
    q = torch.round(runs / scale[:, None]).clamp(-127, 127).to(torch.int8).view(k // 8, 8)  # [K / 8, 8]
    rounded = (q.view(k // RUN, RUN).float() * scale[:, None]).view(k)
    return {"xe": q[:, 0::2].contiguous().view(torch.int32).view(-1),
            "xo": q[:, 1::2].contiguous().view(torch.int32).view(-1), "xs": scale,
            "xsum": rounded.view(k // RUN, RUN).sum(dim=1), "rounded": rounded}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "w4a8-dp4a-probe.json")
    args = parser.parse_args(argv)
    if lacks_cuda():
        return 2
    from tierllm.kernels.quant_gemv import w4_gemv_triton
    from tierllm.quant.formats import dequantize_int4

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        copies = random_int4_copies(n, k, COPIES, gen, GROUP, min_jitter=0.1)
        x = torch.randn(k, device="cuda", generator=gen).bfloat16()
        xq = quantize_x(x)
        nbytes = sum(t.nbytes for t in copies[0].values())
        row = {"shape": name, "n": n, "k": k, "weight_bytes": nbytes,
               "floor_us": round(nbytes / (copy_GBps * 1e9) * 1e6, 2), "tiles": []}
        dense = dequantize_int4(copies[0]["qweight"], copies[0]["scales"], copies[0]["mins"], GROUP, torch.float32)
        ref_x8 = dense @ xq["rounded"]
        ref_bf16 = dense @ x.float()
        y = torch.empty(n, dtype=torch.bfloat16, device="cuda")

        def xhalf(copies=copies, x=x):
            for w in copies:
                w4_gemv_triton(x[None], w["qweight"], w["scales"], w["mins"], GROUP, pdl=True)

        out = w4_gemv_triton(x[None], copies[0]["qweight"], copies[0]["scales"], copies[0]["mins"], GROUP)
        row["xhalf"] = {"us": round(graph_us(xhalf) / COPIES, 2), "rel_err_vs_bf16_x": _rel(out[0], ref_bf16)}
        for rows, groups, warps in TILES:
            label = f"r{rows} g{groups} w{warps}"
            try:
                def run(rows=rows, groups=groups, warps=warps, copies=copies, xq=xq, y=y, n=n, k=k):
                    for w in copies:
                        _w4a8_kernel[(n // rows,)](w["qweight"].view(torch.int32), xq["xe"], xq["xo"], xq["xs"],
                                                   xq["xsum"], w["scales"], w["mins"], y, KW=k // 8, ROWS=rows,
                                                   GPB=groups, num_warps=warps, launch_pdl=True)
                us = graph_us(run) / COPIES
                _w4a8_kernel[(n // rows,)](copies[0]["qweight"].view(torch.int32), xq["xe"], xq["xo"], xq["xs"],
                                           xq["xsum"], copies[0]["scales"], copies[0]["mins"], y, KW=k // 8,
                                           ROWS=rows, GPB=groups, num_warps=warps)
                row["tiles"].append({"tile": label, "us": round(us, 2), "rel_err_vs_int8_x": _rel(y, ref_x8),
                                     "rel_err_vs_bf16_x": _rel(y, ref_bf16)})
            except Exception as error:                # a tile that does not compile: recorded, the rest run
                row["tiles"].append({"tile": label, "error": f"{type(error).__name__}: {error}"[:300]})
            print(name, row["tiles"][-1], flush=True)
        print(name, "xhalf", row["xhalf"], "floor", row["floor_us"], flush=True)
        rows_out.append(row)
        del copies
        torch.cuda.empty_cache()
    write_result(args.out, "w4a8-dp4a-probe", torch.device("cuda"), {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: a probe of a kernel design of this project"}, {"shapes": rows_out}, [],
                 {"copies": COPIES, "group": GROUP, "x_run": RUN, "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
