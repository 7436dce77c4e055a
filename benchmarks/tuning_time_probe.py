"""What a decode GEMV's first-use tuning costs: the int4 tensor-core GEMV (w4_mma_gemv, 2-8 x rows; --kernel gemm:
the int4 GEMM of prefill and batches over 8 rows, quant_gemm.py, under Triton's autotuner) on one weight shape, its
first call timed with a cold Triton cache and a fresh tuning file, compiling in process
(TIERLLM_COMPILE_WORKERS=0) and then in worker processes (parallel_compile.py, the default), then with the Triton
cache warm (compiled kernels on disk) and a fresh tuning file. The difference to the warm run is compile time.

    python benchmarks/tuning_time_probe.py [--n 8192] [--k 8192] [--rows 4] [--kernel mma|gemm]

(The GEMM's autotuner keeps its picks in the Triton cache: with the cache warm it times nothing.)

Runs both processes itself (each with its own TRITON_CACHE_DIR / TIERLLM_TUNING_CACHE under a temp folder) and
prints one line per process."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _child(n: int, k: int, rows: int, kernel: str) -> None:
    import torch

    from tierllm.kernels import quant_gemm
    from tierllm.kernels.graph_tuning import TUNED_SITES
    from tierllm.kernels.w4_mma_gemv import w4_mma_gemv
    from tierllm.quant.quantize import quantize_int4

    q = quantize_int4(torch.randn(n, k, device="cuda"), 64, symmetric=False)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def call() -> None:
        if kernel == "gemm":
            quant_gemm.quant_gemm_triton(x, q["qweight"], q["scales"], q["mins"], 4, 64)
        else:
            w4_mma_gemv(x, q["qweight"], q["scales"], q["mins"])

    torch.cuda.synchronize()
    start = time.perf_counter()
    call()                                                          # tunes: compiles and times every config
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    if kernel == "gemm":
        timed = len(getattr(quant_gemm._quant_gemm_kernel, "configs_timings", None) or {})
    else:
        timed = len(TUNED_SITES[-1].timings) if TUNED_SITES else 0
    print(json.dumps({"first_call_s": round(first, 2), "second_call_ms": round((time.perf_counter() - start) * 1e3, 3),
                      "configs_timed": timed}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--kernel", choices=("mma", "gemm"), default="mma")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.n, args.k, args.rows, args.kernel)
        return 0
    runs = (("cold Triton cache, compiled in process", "cold1", "0"),
            ("cold Triton cache, compiled in workers", "cold2", os.environ.get("TIERLLM_COMPILE_WORKERS", "")),
            ("warm Triton cache", "cold2", "0"))
    with tempfile.TemporaryDirectory() as tmp:
        for label, triton_cache, workers in runs:
            env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(tmp, triton_cache),
                   "TIERLLM_TUNING_CACHE": os.path.join(tmp, f"{label}.json"), "TIERLLM_COMPILE_WORKERS": workers}
            if not workers:
                env.pop("TIERLLM_COMPILE_WORKERS")
            out = subprocess.run([sys.executable, __file__, "--child", "--n", str(args.n), "--k", str(args.k),
                                  "--rows", str(args.rows), "--kernel", args.kernel], env=env, capture_output=True,
                                 text=True, check=True)
            print(f"{label}, fresh tuning file: [{args.rows}, {args.k}] x [{args.k}, {args.n}] int4 {args.kernel} "
                  f"{out.stdout.strip().splitlines()[-1]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
