"""On a CUDA GPU: the graph tuner's first use, and Triton's autotuner of the int4 GEMM (precompiling), record each
config's kernel specializations and compile them in worker processes (tierllm/kernels/parallel_compile.py); the
timing launches then find every one of them in Triton's cache. Each runs in a fresh process with an empty Triton
cache, so that nothing is compiled beforehand."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHILD = r"""
import json, pathlib, sys, torch
from tierllm.kernels import graph_tuning
from tierllm.kernels.gemv import gemv_triton, linear_ref

cache = pathlib.Path(sys.argv[1])
cubins = lambda: {str(p) for p in cache.rglob("*.cubin")}
seen = {}
original = graph_tuning.precompile

def counted(configs, launch, weight):
    seen["configs"] = len(configs)
    seen["compiled"] = original(configs, launch, weight)
    seen["cubins_after_workers"] = sorted(cubins())
    return seen["compiled"]

graph_tuning.precompile = counted
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(3072, 2048, device="cuda", dtype=torch.bfloat16) / 45
y = gemv_triton(x, w)
seen["err"] = ((y.float() - linear_ref(x, w).float()).norm() / linear_ref(x, w).float().norm()).item()
seen["timed"] = len(graph_tuning.TUNED_SITES[-1].timings)
seen["new_cubins_after_timing"] = sorted(cubins() - set(seen.pop("cubins_after_workers")))
print(json.dumps(seen))
"""


def test_first_use_compiles_in_workers_and_the_timing_reads_their_cache(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TIERLLM_TUNING_CACHE": "0",
           "TIERLLM_COMPILE_WORKERS": "4", "TIERLLM_GEMV_TUNER": "graph"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", CHILD, env["TRITON_CACHE_DIR"]], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["configs"] > 2 and seen["compiled"] == seen["configs"] and seen["timed"] >= 1, out.stderr[-3000:]
    assert seen["new_cubins_after_timing"] == []           # every timed config came from the workers' compiles
    assert seen["err"] < 1e-2


GEMM_CHILD = r"""
import json, pathlib, sys, torch
import tierllm
from tierllm.kernels import parallel_compile, quant_gemm
from tierllm.kernels.quant_gemv import w4_linear_ref
from tierllm.quant.quantize import quantize_weight

cache = pathlib.Path(sys.argv[1])
cubins = lambda: {str(p) for p in cache.rglob("*.cubin")}
seen = {"configs": [], "compiled": []}
original = parallel_compile.precompile

def counted(configs, launch, weight):
    seen["configs"].append(len(configs))
    seen["compiled"].append(original(configs, launch, weight))
    seen["cubins_after_workers"] = sorted(cubins())
    return seen["compiled"][-1]

parallel_compile.precompile = counted
w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) / 45
q = quantize_weight(w, tierllm.QuantConfig(bits=4))
x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
y = quant_gemm.quant_gemm_triton(x, q["qweight"], q["scales"], q["mins"], 4, 64)
ref = w4_linear_ref(x, q["qweight"], q["scales"], q["mins"], 64).float()
seen["err"] = ((y.float() - ref).norm() / ref.norm()).item()
seen["new_cubins_after_timing"] = sorted(cubins() - set(seen.pop("cubins_after_workers")))
print(json.dumps(seen))
"""


def test_the_int4_gemm_autotuner_compiles_in_workers_before_timing(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TIERLLM_TUNING_CACHE": "0",
           "TIERLLM_COMPILE_WORKERS": "8"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", GEMM_CHILD, env["TRITON_CACHE_DIR"]], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen["configs"]) == 1 and seen["configs"][0] > 2, seen          # one new key, timed once
    assert seen["compiled"] == seen["configs"], seen
    assert seen["new_cubins_after_timing"] == []           # every timed config came from the workers' compiles
    assert seen["err"] < 2e-2
