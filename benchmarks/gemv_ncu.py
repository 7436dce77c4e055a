"""Nsight Compute target: why the int4 GEMVs read HBM at 24-48% of the copy rate where int8's SUM16 loop reaches
72-86% and bf16's 77-89% (one GPU, batch 1, llama-7b's qkv and down shapes; benchmarks/notes/gpu-decode.md,
"INT4_SUB"). Launches, twice each (the second is the one to read: the first compiles), the bf16 GEMV, the int8 ROW +
SUM16 loop, the int4 INT4_ROW loop (PTX nibbles) and INT4_SUB, each at its fastest config in the H200 grids
(int8-row-grid-sum16-h200.json, int4-sub-grid-h200.json; bf16: the tuner's picks in int8-row-ab-h200.json).
Run under ncu:

    ncu --clock-control none -k regex:_gemv_body --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/gemv_ncu.py

(benchmarks/quant_session.sh ncu). Alone it checks each launch against the torch reference and exits."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_kernel_sweep import rel_err  # noqa: E402

import tierllm  # noqa: E402
from tierllm.kernels import gemv, quant_gemv  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

GROUP = 64
# shape -> {variant: config}
CONFIGS = {
    (12288, 4096): {"bf16": dict(BLOCK_N=4, BLOCK_K=4096, num_warps=8, num_stages=1),
                    "int8 sum16": dict(BLOCK_N=8, BLOCK_K=512, ROW=True, SUM16=True, num_warps=2, num_stages=1),
                    "int4 row": dict(BLOCK_N=4, GROUPS_PER_BLOCK=16, INT4_ROW=True, NIBBLES=2, num_warps=4,
                                     num_stages=2),
                    "int4 sub": dict(BLOCK_N=16, GROUPS_PER_BLOCK=8, INT4_ROW=True, INT4_SUB=True, num_warps=2,
                                     num_stages=1)},
    (4096, 11008): {"bf16": dict(BLOCK_N=2, BLOCK_K=1024, num_warps=2, num_stages=2),
                    "int8 sum16": dict(BLOCK_N=8, BLOCK_K=2048, ROW=True, SUM16=True, num_warps=8, num_stages=1),
                    "int4 row": dict(BLOCK_N=4, GROUPS_PER_BLOCK=8, INT4_ROW=True, NIBBLES=2, num_warps=4,
                                     num_stages=2),
                    "int4 sub": dict(BLOCK_N=8, GROUPS_PER_BLOCK=8, INT4_ROW=True, INT4_SUB=True, num_warps=4,
                                     num_stages=1)},
}


def launch(variant: str, config: dict, x: torch.Tensor, w: torch.Tensor, q8: dict, q4: dict,
           y: torch.Tensor) -> torch.Tensor:
    """One launch of `variant` writing y; returns its reference."""
    n, k = w.shape
    if variant.startswith("int4"):
        even = quant_gemv.w4_even({"N": n, "K": k, "GROUP": GROUP, **config})
        quant_gemv._w4_gemv_body[(1, triton.cdiv(n, config["BLOCK_N"]))](
            x, q4["qweight"], q4["scales"], q4["mins"], q4["scales"], q4["scales"], y, 1, n, k, x.stride(0),
            q4["qweight"].stride(0), q4["scales"].stride(0), y.stride(0), 1e-6, GROUP=GROUP, HAS_MINS=True,
            HAS_BIAS=False, NORM=False, GATED=False, RESIDUAL=False, **config, EVEN=even)
        return quant_gemv.w4_linear_ref(x, q4["qweight"], q4["scales"], q4["mins"], GROUP)
    int8 = variant.startswith("int8")
    weight, scales = (q8["qweight"], q8["scales"]) if int8 else (w, w)
    gemv._gemv_body[(triton.cdiv(n, config["BLOCK_N"]),)](
        x, weight, scales, scales, scales, y, 1, n, k, x.stride(0), weight.stride(0), y.stride(0), 1e-6,
        HAS_BIAS=False, NORM=False, GATED=False, RESIDUAL=False, INT8=int8, BLOCK_M=1, **config)
    return quant_gemv.w8_linear_ref(x, weight, scales) if int8 else gemv.linear_ref(x, w)


def main() -> int:
    torch.manual_seed(0)
    for (n, k), variants in CONFIGS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q8 = quantize_weight(w, tierllm.QuantConfig(bits=8))
        q4 = quantize_weight(w, tierllm.QuantConfig(bits=4, group_size=GROUP))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for variant, config in variants.items():
            y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                ref = launch(variant, config, x, w, q8, q4, y)
            err = rel_err(y, ref)
            print(f"{n} x {k} {variant} {config}: rel err {err:.1e}", flush=True)
            if err > 1e-2:
                print("error: the launch does not match its reference", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
