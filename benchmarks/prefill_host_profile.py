"""Where a batch-1 prefill's host time goes: `llama-7b` preset, bf16 and int4, one 512-token prompt.

    python benchmarks/prefill_host_profile.py [--variants bf16,bf16+graphs,int4] [--prompt-len 512] [--out PATH]

A "+graphs" variant captures prefill steps as CUDA graphs (mixed_graph_tokens = the prompt length). Per variant:
the prefill's latency (new prompts, after a warm-up at the same length), the sum of its kernels' device time and the
host's span from the first to the last launch (torch.profiler), and the Python functions with the most time under
cProfile (which slows the host: its times rank, they do not measure). Prints a table and
writes JSON (device, versions, date) to --out."""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
from pathlib import Path

import torch

from tierllm.api import InferenceEngine, build_engine
from tierllm.bench.generate_bench import _random_prompts
from tierllm.bench.presets import build_preset_hf_model
from tierllm.bench.quant_presets import preset_quant_checkpoint
from tierllm.bench.results import write_result

PRESET = "llama-7b"


def _engine(variant: str, prompt_len: int) -> InferenceEngine:
    weights, _, graphs = variant.partition("+")
    kwargs = {"dtype": torch.bfloat16, "device": "cuda", "max_model_len": 1024, "max_num_seqs": 1,
              "max_num_batched_tokens": prompt_len, "show_progress": False, "gpu_memory_utilization": 0.9,
              "mixed_graph_tokens": prompt_len if graphs == "graphs" else 0}
    source = build_preset_hf_model(PRESET, torch.bfloat16, "cuda", 0) if weights == "bf16" else \
        preset_quant_checkpoint(PRESET, weights, torch.bfloat16, "cuda", 0)
    return InferenceEngine(*build_engine(source, **kwargs))


def _prefill_s(engine: InferenceEngine, ids: torch.Tensor) -> float:
    torch.cuda.synchronize()
    engine.generate(ids, max_new_tokens=1, min_new_tokens=1)
    torch.cuda.synchronize()
    return engine.profile.prefill_latency_s


def _profiled(engine: InferenceEngine, ids: torch.Tensor) -> dict:
    """One prefill under torch.profiler -> kernel time, host launch span, launch count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _prefill_s(engine, ids)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                       "cudaLaunchKernelExC")]
    span = (max(e.time_range.end for e in launches) - min(e.time_range.start for e in launches)) / 1e3 \
        if launches else None
    return {"kernels": len(events), "kernel_ms": round(sum(e.device_time for e in events) / 1e3, 3),
            "launches": len(launches), "host_launch_span_ms": round(span, 3) if span is not None else None}


def _python_top(engine: InferenceEngine, ids: torch.Tensor, top: int) -> dict:
    """One prefill under cProfile -> the functions with the most own time, and tierllm's with the most cumulative
    time: [name, calls, own ms, cumulative ms]."""
    profiler = cProfile.Profile()
    profiler.enable()
    _prefill_s(engine, ids)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO()).stats
    rows = [[f"{Path(file).name}:{line}:{name}", calls, round(own * 1e3, 2), round(cum * 1e3, 2), file]
            for (file, line, name), (_, calls, own, cum, _) in stats.items()]
    ours = [row for row in rows if "/tierllm/" in row[4]]
    return {"own": [row[:4] for row in sorted(rows, key=lambda row: row[2], reverse=True)[:top]],
            "tierllm_cumulative": [row[:4] for row in sorted(ours, key=lambda row: row[3], reverse=True)[:top]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ.get("OUT", "benchmarks/results")) / "prefill-host-profile.json"
    parser.add_argument("--variants", default="bf16,bf16+graphs,int4")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    results = {}
    for seed, variant in enumerate(args.variants.split(",")):
        engine = _engine(variant, args.prompt_len)
        vocab = engine.model.config.vocab_size
        prompts = iter(_random_prompts(8, args.prompt_len, vocab, 100 + seed).cuda().split(1))
        _prefill_s(engine, next(prompts))                                   # the first use tunes and compiles
        latency = sorted(_prefill_s(engine, next(prompts)) for _ in range(3))
        profiled = _profiled(engine, next(prompts))
        results[variant] = {"prefill_ms": [round(s * 1e3, 2) for s in latency], **profiled,
                            "python_ms": _python_top(engine, next(prompts), args.top)}
        r = results[variant]
        print(f"{variant}: prefill {r['prefill_ms']} ms | {r['kernels']} kernels, {r['kernel_ms']} ms on the device | "
              f"{r['launches']} launches over {r['host_launch_span_ms']} ms of host time", flush=True)
        for kind, rows in r["python_ms"].items():
            print(f"  by {kind} time (cProfile):")
            for row in rows:
                print(f"    {row[0]:<70} calls {row[1]:>6}  own {row[2]:>8} ms  cum {row[3]:>8} ms")
        del engine
        torch.cuda.empty_cache()
    write_result(args.out, "prefill-host-profile", torch.device("cuda"), {"device": torch.cuda.get_device_name()},
                 {"note": "a diagnostic of our own prefill (host against device time): no peer run"},
                 results, [], {"preset": PRESET, "prompt_len": args.prompt_len})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
