"""The int4 wgmma GEMM (tierllm/kernels/int4_wgmma.py) per llama-7b linear on one H100/H200, against the engine's
Triton GEMM (quant_gemm.py, its autotuner's pick for the row count) and cuBLAS bf16 (issue #5: int4 decode no
slower than bf16 at batch 64). Times each K split on x given in the kernel's k order, and the engine's path (x as
it is, its pairs gathered by the kernel's copies, at split_for's split).

Timed as the graph tuner times a config (graph_tuning.graph_seconds: CUDA graphs over weight copies that miss L2);
each split is first checked against the torch reference and for identical bits over REPEATS reruns.

The kernel's forms on an H200 at 64 rows, us per layer (cuBLAS bf16 121-123, the Triton GEMM 143):
- 62ceb6d: uint8 loads and a PTX block per 4 bytes, split K by atomics: 197 (int4-wgmma-probe-h200.json);
- ba23bd0: x through a cp.async ring, split K in the kernel: 154 (int4-wgmma-probe-ring-h200.json);
- int32 word loads, one PTX block per word (249 -> 161 SASS per group offline): 127.5
  (int4-wgmma-probe-words-h200.json);
- four groups per iteration in their own registers (a rotating prefetch waited on its newest load at every
  move): 115-124 (int4-wgmma-probe-unroll-h200.json, int4-wgmma-probe-async-h200.json). In the second of these an
  asynchronous MMA (the next group dequantized while it runs) gained nothing, and with the rotating prefetch its
  outputs differed from run to run (a race); not kept.
- ada0427: x's ring as four buffers (one barrier per group): 120.5, no faster; two warpgroups per program (--warps
  8, 128 weight rows sharing x's tiles) slower on every shape and split (int4-wgmma-probe-four-buffers-m64-h200.json).
- 4774369: the k order over spans of 256, lane t holding group t of each span (one scale and min per lane and row
  per span; 118 SASS instructions per 64 k against 130, half the loads' L1 wavefronts): 100.8 (32 rows 81.0, 16
  rows 71.6; int4-wgmma-probe-spans-m{64,32,16}-h200.json).

    python benchmarks/int4_wgmma_probe.py [--out PATH] [--rows 64] [--warps 4,8]"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
SPLITS = (1, 2, 4, 8)
REPEATS = 20                  # reruns of each split whose outputs must equal its first run's, bit for bit


def main(argv=None) -> int:
    from int4_gemm_m64_grid import layer_summary
    from quant_kernel_sweep import rel_err

    import tierllm
    from tierllm.bench.probe import hbm_copy_GBps
    from tierllm.bench.results import write_result
    from tierllm.kernels import int4_wgmma, quant_gemm, quant_gemv
    from tierllm.kernels.graph_tuning import graph_seconds, weight_copies
    from tierllm.quant.quantize import quantize_weight

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int4-wgmma-probe.json"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--warps", default="4,8", help="warps per program to time (4: 64 weight rows, 8: 128)")
    args = parser.parse_args(argv)
    warps_list = [int(w) for w in args.warps.split(",")]
    torch.manual_seed(0)
    started = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize_weight(w, tierllm.QuantConfig(bits=4))
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        xp = int4_wgmma.to_k_order_ref(x).contiguous()
        ref = quant_gemv.w4_linear_ref(x, q["qweight"], q["scales"], q["mins"], 64)
        out = torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16)
        copies = weight_copies(q["qweight"])
        cublas = graph_seconds(lambda weight, x=x, out=out: torch.matmul(x, weight.t(), out=out),
                               weight_copies(w)) * 1e6
        triton_us = graph_seconds(lambda codes, x=x, q=q: quant_gemm.quant_gemm_triton(
            x, codes, q["scales"], q["mins"], 4, 64), copies) * 1e6
        timed, engine_by_warps = [], {}
        for warps in warps_list:
            for split in SPLITS:
                run = lambda codes, split=split, warps=warps, q=q, xp=xp: int4_wgmma.w4_wgmma_linear(  # noqa: E731
                    xp, codes, q["scales"], q["mins"], x_permuted=True, split=split, warps=warps)
                y = run(q["qweight"]).clone()
                same_bits = all(torch.equal(run(q["qweight"]), y) for _ in range(REPEATS))
                error = rel_err(y, ref)
                timed.append({"warps": warps, "split": split, "us": round(graph_seconds(run, copies) * 1e6, 2),
                              "rel_err": float(f"{error:.2e}"), "same_bits": same_bits,
                              "correct": error < 2e-2 and same_bits})
            engine = lambda codes, q=q, x=x, warps=warps: int4_wgmma.w4_wgmma_linear(   # noqa: E731
                x, codes, q["scales"], q["mins"], warps=warps)
            engine_error = rel_err(engine(q["qweight"]), ref)
            engine_by_warps[warps] = {"split": int4_wgmma.split_for(-(-n // (16 * warps)), k // 64, sms, args.rows),
                                      "us": round(graph_seconds(engine, copies) * 1e6, 2),
                                      "rel_err": float(f"{engine_error:.2e}")}
        ok = sorted((t for t in timed if t["correct"]), key=lambda t: t["us"])
        engine_best = min(engine_by_warps.items(), key=lambda item: item[1]["us"])
        rows[name] = {"shape": [n, k], "cublas_bf16_us": round(cublas, 2), "triton_gemm_us": round(triton_us, 2),
                      "wgmma_by_split": timed, "wgmma_best": ok[0] if ok else None,
                      "engine_by_warps": engine_by_warps, "engine_warps": engine_best[0],
                      "engine_us": engine_best[1]["us"], "engine_rel_err": engine_best[1]["rel_err"]}
        best = f"{ok[0]['us']} us (warps {ok[0]['warps']}, split {ok[0]['split']})" if ok else "none correct"
        engines = " | ".join(f"w{w} split {e['split']} {e['us']:.1f}" for w, e in engine_by_warps.items())
        print(f"{name:>8} {n}x{k} M={args.rows}: cuBLAS bf16 {cublas:.1f} us | Triton GEMM {triton_us:.1f} | "
              f"wgmma {best} | engine (x gathered) {engines}", flush=True)
        for t in timed:
            print(f"           {t}", flush=True)
        del w, q, copies
        torch.cuda.empty_cache()
    totals = {key: round(sum(r[key] for r in rows.values()), 2)
              for key in ("cublas_bf16_us", "triton_gemm_us", "engine_us")}
    if all(r["wgmma_best"] for r in rows.values()):
        totals["wgmma_best_us"] = round(sum(r["wgmma_best"]["us"] for r in rows.values()), 2)
    print(f"per layer: {totals} ({time.perf_counter() - started:.0f} s)")
    ceilings, ratios = layer_summary(totals, hbm_copy_GBps())
    peers = {"cublas_bf16_us_per_layer": totals["cublas_bf16_us"],
             "note": "torch.matmul on the bf16 weight, per shape in results.shapes"}
    write_result(args.out, "int4_wgmma_probe", torch.device("cuda"), ceilings, peers,
                 {"shapes": rows, "per_layer": totals, "per_layer_over_cublas_bf16": ratios}, [],
                 {"rows": args.rows, "warps": warps_list,
                  "note": "wgmma_by_split: x permuted outside the timing; engine_us: x as it is (gathered by the "
                          "kernel's copies) at split_for's split, the faster of the warps timed (engine_by_warps)"})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
