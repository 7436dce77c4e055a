"""Nsight Compute target: why int8 GEMVs read HBM at ~70% of the copy rate where bf16's reach 77-87% (one GPU,
batch 1, llama-7b's qkv and down shapes; benchmarks/notes/gpu-decode.md, "The int8 one-row loop"). Launches, twice
each (the second is the one to read: the first compiles), the bf16 GEMV, the int8 ROW loop and the int8 general
loop, each at the config that was fastest in int8_row_ab.py's first grid / the bf16 tuner on an H200, and the ROW
loop with SUM16 (half the registers; not timed yet) at a config of the same weight bytes per thread as bf16's.
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

# shape -> {variant: config}; int8 from int8-row-grid-h200.json, bf16 the tuner's picks in int8-row-ab-h200.json
CONFIGS = {
    (12288, 4096): {"bf16": dict(BLOCK_N=4, BLOCK_K=4096, num_warps=8, num_stages=1),
                    "int8 row": dict(BLOCK_N=16, BLOCK_K=256, ROW=True, num_warps=4, num_stages=1),
                    "int8 general": dict(BLOCK_N=4, BLOCK_K=2048, num_warps=2, num_stages=1),
                    "int8 sum16": dict(BLOCK_N=16, BLOCK_K=1024, ROW=True, SUM16=True, num_warps=4, num_stages=1)},
    (4096, 11008): {"bf16": dict(BLOCK_N=2, BLOCK_K=1024, num_warps=2, num_stages=2),
                    "int8 row": dict(BLOCK_N=8, BLOCK_K=1024, ROW=True, num_warps=4, num_stages=2),
                    "int8 general": dict(BLOCK_N=4, BLOCK_K=4096, num_warps=4, num_stages=1),
                    "int8 sum16": dict(BLOCK_N=8, BLOCK_K=1024, ROW=True, SUM16=True, num_warps=4, num_stages=1)},
}


def main() -> int:
    torch.manual_seed(0)
    for (n, k), variants in CONFIGS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize_weight(w, tierllm.QuantConfig(bits=8))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for variant, config in variants.items():
            int8 = variant.startswith("int8")
            weight, scales = (q["qweight"], q["scales"]) if int8 else (w, w)
            ref = quant_gemv.w8_linear_ref(x, weight, scales) if int8 else gemv.linear_ref(x, w)
            y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                gemv._gemv_body[(triton.cdiv(n, config["BLOCK_N"]),)](
                    x, weight, scales, scales, scales, y, 1, n, k, x.stride(0), weight.stride(0), y.stride(0), 1e-6,
                    HAS_BIAS=False, NORM=False, GATED=False, RESIDUAL=False, INT8=int8, BLOCK_M=1, **config)
            err = rel_err(y, ref)
            print(f"{n} x {k} {variant} {config}: rel err {err:.1e}", flush=True)
            if err > 1e-2:
                print("error: the launch does not match its reference", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
