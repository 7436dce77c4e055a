"""Nsight Compute target: where the int4 wgmma GEMM (tierllm/kernels/int4_wgmma.py) spends its time at 64 x rows,
where it only ties cuBLAS bf16 per llama-7b layer (benchmarks/int4_wgmma_probe.py). Launches the kernel twice per
case (the second launch is the one to read; the first compiles) on gate/up (split 1) and o (split 4), x given in
the kernel's k order and gathered, then checks each output against the reference. Run under ncu with source-level
sampling (benchmarks/quant_session.sh wgmma-ncu):

    ncu --clock-control none -k regex:_w4_wgmma --launch-skip-before-match 0 --section WarpStateStats \\
        --section SourceCounters --section SchedulerStats --section Occupancy --section SpeedOfLight \\
        --import-source no -o REPORT python3 benchmarks/int4_wgmma_ncu.py"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_kernel_sweep import rel_err  # noqa: E402

import tierllm  # noqa: E402
from tierllm.kernels import int4_wgmma, quant_gemv  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

ROWS = 64
# name: (N, K, split): the fastest split per shape at 64 rows (results/int4-wgmma-probe-m64-h200.json)
SHAPES = {"gate_up": (22016, 4096, 1), "o": (4096, 4096, 4)}


def main() -> int:
    torch.manual_seed(0)
    for name, (n, k, split) in SHAPES.items():
        q = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                            tierllm.QuantConfig(bits=4))
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_gemv.w4_linear_ref(x, q["qweight"], q["scales"], q["mins"], 64)
        for permuted in (True, False):
            given = int4_wgmma.to_k_order_ref(x).contiguous() if permuted else x
            for _ in range(2):
                y = int4_wgmma.w4_wgmma_linear(given, q["qweight"], q["scales"], q["mins"], x_permuted=permuted,
                                               split=split)
            torch.cuda.synchronize()
            print(f"{name} split {split} x {'permuted' if permuted else 'gathered'}: rel err {rel_err(y, ref):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
