"""Nsight Compute target: why the int4 GEMVs, on the CUDA cores (quant_gemv.py) and on the tensor cores
(w4_mma_gemv.py), read HBM at 25-50% of the copy rate at batch 1 on llama-7b's shapes (benchmarks/w4_mma_grid.py).
Launches each kernel twice at the graph tuner's picks (the second launch is the one to read; the first compiles)
on the o, down, qkv and gate/up shapes, then checks it against the reference. Run under ncu:

    ncu --clock-control none -k regex:w4_ --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 benchmarks/w4_mma_ncu.py

(benchmarks/quant_session.sh mma-ncu)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_kernel_sweep import rel_err  # noqa: E402

import tierllm  # noqa: E402
from tierllm.kernels import quant_gemv  # noqa: E402
from tierllm.kernels.int4_prepared_x import prepare_x_half_triton  # noqa: E402
from tierllm.kernels.w4_mma_gemv import w4_mma_gemv  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

GROUP = 64
# the CUDA-core loop as the graph tuner took it on an H200 (quant-bf16-int4-xhalf-llama-7b-h200.json): XGLOBAL with
# the products in packed fp16 (XHALF), PAIRED where ungated, on x prepared by int4_prepared_x's half layout
CUDA_CORE = dict(BLOCK_N=4, GROUPS_PER_BLOCK=16, INT4_ROW=True, INT4_SUB=True, XGLOBAL=True, XHALF=True, num_warps=4,
                 num_stages=1)
# name: (rows, K, gated, residual, tensor-core configs: the tuner's picks for o and down)
SHAPES = {"o": (4096, 4096, False, True, [dict(WARPS=8, UNROLL=8, TWO_TILES=False)]),
          "down": (4096, 11008, False, True, [dict(WARPS=4, UNROLL=2, TWO_TILES=False, SPLIT_K=4)]),
          "qkv": (12288, 4096, False, False, []),
          "gate_up": (22016, 4096, True, False, [])}


def main() -> int:
    torch.manual_seed(0)
    for name, (rows, k, gated, residual, configs) in SHAPES.items():
        n = rows // 2 if gated else rows
        q = quantize_weight(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                            tierllm.QuantConfig(bits=4, group_size=GROUP))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_gemv.w4_fused_ref(x, q["qweight"], q["scales"], q["mins"], GROUP, gated=gated).float()
        for config in configs:
            for _ in range(2):
                y = torch.zeros(1, n, device="cuda", dtype=torch.bfloat16)
                out = w4_mma_gemv(x, q["qweight"], q["scales"], q["mins"], gated=gated,
                                  residual=y if residual else None, config=config)
            print(f"{name} tensor cores {config}: rel err {rel_err(out, ref):.1e}", flush=True)
        flags = {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": False, "GATED": gated,
                 "RESIDUAL": False, "PAIRED": not gated}
        half_rows = n // 2 if not gated else n                          # PAIRED: each program's rows in each half
        even = quant_gemv.w4_even({"N": half_rows, "K": k, **flags, **CUDA_CORE})
        y = torch.zeros(1, n, device="cuda", dtype=torch.bfloat16)
        x_half = prepare_x_half_triton(x)
        for _ in range(2):
            quant_gemv._w4_gemv_body[(1, triton.cdiv(half_rows, CUDA_CORE["BLOCK_N"]))](
                x_half, q["qweight"], q["scales"], q["mins"], q["scales"], q["scales"], y, 1, half_rows, k, 0,
                q["qweight"].stride(0), q["scales"].stride(0), y.stride(0), 1e-6, **flags, **CUDA_CORE, EVEN=even)
        print(f"{name} CUDA cores {CUDA_CORE} PAIRED={not gated}: rel err {rel_err(y, ref):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
