"""Where batch-1 decode time goes on the GPU (llama-7b preset, bf16): GEMV kernel vs cuBLAS per shape,
decode ms/token with each, and the eager step's kernel table. Writes $OUT/decode_profile.json (device, versions,
date and the HBM copy rate measured in the same run, as every result file)."""
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import tierllm
from tierllm.bench.presets import build_preset_hf_model
from tierllm.bench.probe import hbm_copy_GBps
from tierllm.bench.results import write_result
from tierllm.kernels.gemv import gemv_triton

ceilings = {"hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1)}     # before the engine takes the memory
torch.cuda.empty_cache()
out = {}
for n, k in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    err = ((gemv_triton(x, w).float() - ref).norm() / ref.norm()).item()
    t_cublas = do_bench(lambda: F.linear(x, w), return_mode="median") * 1e-3
    t_gemv = do_bench(lambda: gemv_triton(x, w), return_mode="median") * 1e-3
    out[f"{n}x{k}"] = {"cublas_GBps": round(n * k * 2 / t_cublas / 1e9), "gemv_GBps": round(n * k * 2 / t_gemv / 1e9),
                       "gemv_rel_err": err}
    print(n, k, out[f"{n}x{k}"], flush=True)

hf = build_preset_hf_model("llama-7b", torch.bfloat16, "cuda")
engine = tierllm.init_inference(hf, dtype=torch.bfloat16, max_model_len=1024, max_num_seqs=8, show_progress=False)
del hf
torch.cuda.empty_cache()
ids = torch.randint(100, 32000, (1, 512), device="cuda")


def decode_ms():
    engine.generate(ids, max_new_tokens=8, min_new_tokens=8)
    engine.generate(ids, max_new_tokens=128, min_new_tokens=128)
    return engine.profile.decode_latency_s / 127 * 1e3


out["decode_ms_gemv"] = decode_ms()
os.environ["TIERLLM_GEMV"] = "0"
engine.engine.runner.graphs.capture()
out["decode_ms_cublas"] = decode_ms()
os.environ["TIERLLM_GEMV"] = "1"
engine.engine.runner.graphs.capture()
print(out, flush=True)

engine.engine.runner.use_cuda_graph = False
from torch.profiler import ProfilerActivity, profile
engine.generate(ids, max_new_tokens=4, min_new_tokens=4)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    engine.generate(ids, max_new_tokens=6, min_new_tokens=6)
table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
print(table)
out["kernel_table"] = table
write_result(Path(os.environ.get("OUT", "."), "decode_profile.json"), "decode_profile", torch.device("cuda"),
             ceilings, {}, out, [],
             {"preset": "llama-7b", "dtype": "bfloat16", "batch": 1, "prompt_len": 512, "gen_len": 128,
              "GBps": "weight bytes read / do_bench median (L2 flushed)"})
