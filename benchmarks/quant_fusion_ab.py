"""A/B of the int4 GEMV fusions in the engine (one GPU, llama-7b preset, int4-g64, CUDA graphs): batch-1 decode
time per token with the fusions of quant_gemm.GEMV_FUSIONS[4] set to each option in turn, one engine per option
on the same machine (the graphs bake the choice in). JSON to $OUT/quant-fusion-ab.json.

    python benchmarks/quant_fusion_ab.py [--options none,gated+residual]"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gpu import _engine  # noqa: E402

from tierllm.bench.generate_bench import _random_prompts  # noqa: E402
from tierllm.bench.gpu_bench import _time_ours  # noqa: E402
from tierllm.bench.results import versions  # noqa: E402
from tierllm.kernels import quant_gemm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", default="none,gated+residual")
    args = parser.parse_args()
    engine_args = argparse.Namespace(batch=1, prompt_len=512, seed=0)
    out = {"device": torch.cuda.get_device_name(), "versions": versions(), "preset": "llama-7b int4-g64",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "decode_ms_per_step": {}}
    for option in args.options.split(","):
        quant_gemm.GEMV_FUSIONS[4] = frozenset() if option == "none" else frozenset(option.split("+"))
        engine = _engine("int4", engine_args)
        vocab = engine.model.config.vocab_size
        _time_ours(engine, _random_prompts(1, 512, vocab, 1).cuda(), 16)                          # warm-up
        runs = [_time_ours(engine, _random_prompts(1, 512, vocab, 2 + i).cuda(), 128)["decode_ms_per_step"]
                for i in range(2)]
        out["decode_ms_per_step"][option] = runs
        first = min(next(iter(out["decode_ms_per_step"].values())))
        out["best_over_first_option"] = {o: round(min(r) / first, 4) for o, r in out["decode_ms_per_step"].items()}
        print(f"int4 fusions {option}: batch-1 decode {runs} ms/token", flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        Path(os.environ.get("OUT", "/tmp"), "quant-fusion-ab.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
