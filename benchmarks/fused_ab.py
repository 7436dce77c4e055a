"""A/B of decode variants of a tensor-parallel engine on the llama-13b preset (bf16, CUDA graphs, batch 1): a TP=1
engine, then one engine per variant at TP=N, each in a process of its own (a process sets symmetric memory up for
its first group only), with the variant's environment; ROOT=path runs a variant from another checkout's tierllm
(e.g. an older commit's, unpacked with `git archive`). The variants run in the order given, then again in reverse,
so drift over the run shows. JSON under $OUT (benchmarks/results by default): each engine's batch-1 ms/token, its
fraction of the aggregate HBM roofline and TP=N / TP=1, rank 0's kernel table, its tuned launch configs and its
decode timeline per kernel (the raw kernel lists: timeline-VARIANT-tpN.json beside it).

  python benchmarks/fused_ab.py --tp 2 --variant new: --variant no-pdl:TIERLLM_PDL=0 --variant base:ROOT=/tmp/base
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_key, _value)                  # NVLink multicast stays off on the device machines
sys.path.insert(0, os.environ.get("TIERLLM_AB_ROOT", str(REPO)))   # the variant's tierllm
sys.path.insert(1, str(REPO / "benchmarks"))

import torch  # noqa: E402

PRESET, PROMPT_LEN, GEN_LEN = "llama-13b", 512, 128


def measure_engine(tp_size: int, hbm_GBps: float, trace_path: Path) -> dict:
    """One engine in this process: batch-1 decode twice (after a warm-up), rank 0's kernel table, tuned configs
    and decode timeline (its raw kernel list goes to trace_path)."""
    import tierllm                      # from the variant's root, before tp_gpu puts this checkout first on the path
    from tp_gpu import all_reduce_running, batch1_kernel_table, decode_bytes, open_engine

    from tierllm.bench.generate_bench import _random_prompts
    from tierllm.bench.gpu_bench import _time_ours

    engine, init_s = open_engine(PRESET, tp_size)
    vocab = engine.engine.vocab_size
    _time_ours(engine, _random_prompts(1, PROMPT_LEN, vocab, 2).cuda(), 8)                      # warm-up
    runs = [_time_ours(engine, _random_prompts(1, PROMPT_LEN, vocab, seed).cuda(), GEN_LEN)["decode_ms_per_step"]
            for seed in (1, 3)]
    traffic = decode_bytes(PRESET, tp_size)
    roofline_ms = (traffic["weight_bytes_per_rank"] + traffic["kv_bytes_per_rank"]) / (hbm_GBps * 1e9) * 1e3
    row = {"tierllm": str(Path(tierllm.__file__).parent), "init_s": round(init_s, 1),
           "decode_ms_per_step_runs": runs, "decode_ms_per_step": min(runs),
           "roofline_ms_per_token": round(roofline_ms, 3),
           "fraction_of_aggregate_roofline": round(roofline_ms / min(runs), 4),
           "all_reduce_running": all_reduce_running(engine),
           "batch1_kernel_table_rank0": batch1_kernel_table(engine, vocab)}
    row["tuned_configs_rank0"] = tuned_configs(engine)
    row["step_tuning_rank0"] = getattr(engine.engine.runner, "step_tuning_report", None)  # TIERLLM_STEP_TUNER=1
    try:                                    # (an older ROOT's tierllm may not have kernel_timeline)
        from tierllm.bench.kernel_timeline import profile_decode_timeline
        row["timeline_rank0"] = profile_decode_timeline(engine, vocab, trace_path)
    except Exception as error:              # a diagnostic: the measured row is kept without it
        row["timeline_rank0"] = {"error": repr(error)}
    engine.close()
    return row


def tuned_configs(engine) -> dict:
    """Rank 0's autotuned launch configs, by tuning key: the decode GEMVs' (Triton's tuner: N, K, BLOCK_M, NORM,
    GATED, RESIDUAL, then the argument dtypes; TIERLLM_GEMV_TUNER=graph: gemv.launch_gemv's key) and the fused
    all-reduce's (key: N, K, BLOCK_M, dtype)."""
    from tierllm.kernels import gemv

    picks = {}
    for name, tuner in (("gemv", gemv._gemv_kernel), ("gemv_residual", gemv._gemv_residual_kernel),
                        ("gemv_graph_tuned", getattr(gemv, "_graph_tuner", None))):   # an older ROOT may lack it
        for key, config in getattr(tuner, "cache", {}).items():
            picks[f"{name}{key}"] = str(config)
    fused = engine.engine.runner.parallel.fused_all_reduce
    for key, config in (fused.configs.items() if fused is not None else ()):
        picks[f"fused{key}"] = str(config)
    return picks


def run_child(tp_size: int, label: str, env: dict, hbm_GBps: float, out_dir: Path, timeout: int) -> dict:
    """One engine in a fresh process with the variant's environment; its row (or the error)."""
    env = dict(env)
    root = env.pop("ROOT", None)
    child_env = {**os.environ, **env}
    if root:
        child_env["TIERLLM_AB_ROOT"] = str(Path(root).resolve())
        child_env["PYTHONPATH"] = str(Path(root).resolve())       # spawned workers import the same tierllm
    result = out_dir / f"fused-ab-{label}-tp{tp_size}.row.json"
    command = [sys.executable, __file__, "--child", str(tp_size), "--hbm", str(hbm_GBps), "--row", str(result),
               "--trace", str(out_dir / f"timeline-{label}-tp{tp_size}.json")]
    started = time.perf_counter()
    done = subprocess.run(command, env=child_env, timeout=timeout, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode != 0 or not result.exists():
        return {"error": f"exit {done.returncode}: {done.stderr[-800:]}"}
    row = json.loads(result.read_text())
    result.unlink()
    row.update(variant={**env, **({"ROOT": root} if root else {})}, wall_s=round(time.perf_counter() - started))
    print(f"{label:>12} TP={tp_size}: {row['decode_ms_per_step_runs']} ms/token "
          f"({row['fraction_of_aggregate_roofline']:.1%} of the roofline, {row['all_reduce_running']})", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    parser.add_argument("--no-reverse", action="store_true", help="run the variants once, not there and back")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per engine process")
    parser.add_argument("--no-tp1", action="store_true", help="leave the TP=1 engine out (no ratios)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hbm", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.row).write_text(json.dumps(measure_engine(args.child, args.hbm, Path(args.trace))))
        return 0

    from tierllm.bench.probe import hbm_copy_GBps
    from tierllm.bench.results import check, print_checks, write_result

    variants = []
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        variants.append((name, dict(pair.split("=", 1) for pair in pairs.split(",") if pair)))
    order = variants + ([] if args.no_reverse else variants[::-1])
    out_dir = Path(os.environ.get("OUT", REPO / "benchmarks" / "results"))
    out = out_dir / f"fused-ab-{PRESET}-tp{args.tp}.json"
    started = time.perf_counter()
    ceilings = {"hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1), "num_gpus": torch.cuda.device_count()}
    torch.cuda.empty_cache()
    hbm = ceilings["hbm_copy_GBps(read+write)"]
    settings = {"preset": PRESET, "dtype": "bfloat16", "batch": 1, "prompt_len": PROMPT_LEN, "gen_len": GEN_LEN,
                "tp": args.tp, "order": [name for name, _ in order], "variants": dict(variants)}
    results = {} if args.no_tp1 else {"tp1": run_child(1, "tp1", {}, hbm, out_dir, args.timeout)}
    checks: list[dict] = []
    for i, (name, env) in enumerate(order):
        row = run_child(args.tp, name, env, hbm, out_dir, args.timeout)
        run = 1 if i < len(variants) else 2
        results[f"{name}_tp{args.tp}_run{run}"] = row
        if "error" not in row and "error" not in results.get("tp1", {"error": "left out"}):
            ratio = row["decode_ms_per_step"] / results["tp1"]["decode_ms_per_step"]
            row["ratio_to_tp1"] = round(ratio, 4)
            if args.tp == 2:
                checks.append(check(f"{PRESET} batch 1: time per token TP=2 {name} (run {run}) / TP=1", ratio, "<=",
                                    0.58))
        write_result(out, "fused_ab", torch.device("cuda"), ceilings, {}, results, checks,
                     {**settings, "wall_s": round(time.perf_counter() - started)})
    print_checks(checks)
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
