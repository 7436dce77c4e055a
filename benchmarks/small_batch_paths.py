"""Which kernel a quantized linear should take at decode batches 1-8, one GPU: the GEMV (quant_gemv.py: int8's
reads each weight once for all x rows; int4's runs one program row per x row, so at M rows it streams each weight M
times, L2 permitting) against the GEMM (quant_gemm.py: tensor cores, x padded to its BLOCK_M), and bf16's GEMV and
cuBLAS for scale, on `llama-7b`'s decode linear shapes (plain x @ W^T, bf16 x, int4 group 64 asymmetric). Each
path is autotuned by its first call at each M (Triton's tuner, or TIERLLM_GEMV_TUNER=graph for the GEMVs), then
timed as the graph tuner times a config (graph_tuning.graph_seconds: CUDA graphs cycling through enough weight
copies to miss L2) and checked against the fp32 reference. Why: int4 decoded 0.69-0.72x bf16's tokens/s at batch
8 on an H200 (benchmarks/notes/gpu-decode.md), where the int4 GEMM at batch 64 matches cuBLAS. JSON to
$OUT/small-batch-paths.json.

    python benchmarks/small_batch_paths.py [--rows 1,2,4,8] [LINEAR ...]"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_row_ab import HIDDEN, INTERMEDIATE, PEERS_NOTE  # noqa: E402
from quant_kernel_sweep import rel_err  # noqa: E402

import tierllm  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import versions  # noqa: E402
from tierllm.kernels import gemv, quant_gemm, quant_gemv  # noqa: E402
from tierllm.kernels.graph_tuning import graph_seconds, weight_copies  # noqa: E402
from tierllm.quant.formats import dequantize_int4, dequantize_int8  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

GROUP = 64
SHAPES = {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE)}


def paths(q4: dict, q8: dict) -> dict:
    """name -> (launch(x, weight) -> y, the weight whose copies the timing cycles through)."""
    return {
        "int4_gemv": (lambda x, w: quant_gemv.w4_gemv_triton(x, w, q4["scales"], q4["mins"], GROUP), q4["qweight"]),
        "int4_gemm": (lambda x, w: quant_gemm.quant_gemm_triton(x, w, q4["scales"], q4["mins"], 4, GROUP),
                      q4["qweight"]),
        "int8_gemv": (lambda x, w: quant_gemv.w8_gemv_triton(x, w, q8["scales"]), q8["qweight"]),
        "int8_gemm": (lambda x, w: quant_gemm.quant_gemm_triton(x, w, q8["scales"], None, 8, None), q8["qweight"]),
    }


def shape_rows(name: str, rows: list[int], hbm_Bps: float) -> dict:
    n, k = SHAPES[name]
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q4 = quantize_weight(dense, tierllm.QuantConfig(bits=4, group_size=GROUP))
    q8 = quantize_weight(dense, tierllm.QuantConfig(bits=8))
    refs = {"int4": dequantize_int4(q4["qweight"], q4["scales"], q4["mins"], GROUP, torch.float32),
            "int8": dequantize_int8(q8["qweight"], q8["scales"], torch.float32), "bf16": dense.float()}
    launches = {**paths(q4, q8), "bf16_gemv": (gemv.gemv_triton, dense),
                "bf16_cublas": (lambda x, w: x @ w.t(), dense)}
    out = {"shape": [n, k], "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {}
        for path, (launch, weight) in launches.items():
            ref = x.float() @ refs[path.split("_")[0]].t()
            try:
                y = launch(x, weight)                                   # tunes at this M, compiles
                copies = weight_copies(weight)
                seconds = graph_seconds(lambda w, launch=launch: launch(x, w), copies)
            except Exception as failure:                                 # a path that cannot run this M: recorded
                row[path] = {"error": f"{type(failure).__name__}: {str(failure)[:120]}"}
                continue
            nbytes = weight.numel() * weight.element_size()
            row[path] = {"us": round(seconds * 1e6, 2), "rel_err": rel_err(y.float(), ref),
                         "weight_fraction_of_hbm_copy": round(nbytes / seconds / hbm_Bps, 3)}
        out["rows"][m] = row
        print(f"{name} M={m}: " + ", ".join(f"{p} {r.get('us', 'error')}" for p, r in row.items()), flush=True)
        torch.cuda.empty_cache()
    return out


def main() -> int:
    started = time.perf_counter()
    args = sys.argv[1:]
    rows = [1, 2, 4, 8]
    if "--rows" in args:
        at = args.index("--rows")
        rows = [int(r) for r in args[at + 1].split(",")]
        del args[at:at + 2]
    hbm_Bps = hbm_copy_GBps() * 1e9
    torch.manual_seed(0)
    result = {"benchmark": "small_batch_paths", "device": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
              "hbm_copy_GBps": round(hbm_Bps / 1e9, 1), "peers_note": PEERS_NOTE + "; cuBLAS bf16 is timed for scale",
              "gemv_tuner": os.environ.get("TIERLLM_GEMV_TUNER", "triton"), "linears": {}}
    out_path = Path(os.environ.get("OUT", "/tmp")) / "small-batch-paths.json"
    for name in args or list(SHAPES):
        result["linears"][name] = shape_rows(name, rows, hbm_Bps)
        result["wall_s"] = round(time.perf_counter() - started)
        out_path.write_text(json.dumps(result, indent=1))               # rewritten per linear: a cut call keeps them
    print(f"wrote {out_path} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
