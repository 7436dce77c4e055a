"""Tensor parallelism on the device machine (2 or 4 GPUs, bf16, random-weight presets opened by every rank
itself), one full measurement per call, JSON under $OUT:

  python benchmarks/tp_gpu.py --tp-sizes 1,2        # nvidia-h100-x2
  python benchmarks/tp_gpu.py --tp-sizes 1,2,4      # nvidia-h100-x4 (adds TP=4 and the llama-70b run)
  ... --all-reduce symm_mem                         # the one-shot symmetric-memory all-reduce (distributed/)
  ... --all-reduce fused                            # decode's row-parallel all-reduce inside the GEMV
  ... --variant a:ENV=1 --variant b:ENV=0           # A/B: one llama-13b engine per variant at each TP size > 1
  ... --invariant --skip-70b                        # agreement only, tensor_parallel invariant=True at every TP

(a) agreement: TP=N greedy tokens vs TP=1 on the smollm2-1.7b and llama-13b presets. Random weights give flat
    logits, so a free-running comparison diverges for good after the first near-tie; the check is teacher-forced:
    on every prefix of TP=1's own continuation, does TP=N pick the same next token (>= 95%)? Free-running
    agreement is reported too. (SmolLM2-135M's 9 heads split over neither 2 nor 4 GPUs: its error is recorded.)
    A TP=1 fp32 engine on the same weights answers the same prefixes: every bf16 engine's agreement with those exact
    answers is reported beside the check, TP=1's own being the noise floor of bf16 on near-flat logits.
(b) llama-13b batch-1 time per token, TP=2 vs TP=1 (<= 0.58x); llama-70b (4 GPUs) batch-1 time per token vs the
    aggregate HBM roofline (>= 75%); batch-64 throughput of llama-13b at every TP size (and llama-70b at TP=4).
Ceilings (HBM copy bandwidth, bf16 matmul rate) are measured on GPU 0 in the same run."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_key, _value)                  # NVLink multicast stays off on the device machines

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout: python benchmarks/tp_gpu.py

import torch  # noqa: E402

import tierllm  # noqa: E402
from tierllm.bench.generate_bench import _random_prompts  # noqa: E402
from tierllm.bench.gpu_bench import _kv_bytes_per_token_of_context, _time_ours  # noqa: E402
from tierllm.bench.presets import PresetSource  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps, matmul_TFLOPs  # noqa: E402
from tierllm.bench.results import check, print_checks, write_result  # noqa: E402
from tierllm.distributed.parallel_state import ALL_REDUCE_KINDS  # noqa: E402

DTYPE = torch.bfloat16
PROMPT_LEN, LATENCY_GEN_LEN, THROUGHPUT_GEN_LEN, THROUGHPUT_BATCH = 512, 128, 32, 64
PEERS = {"note": "no peer engine runs here (none is installed on the device image); the baseline is this engine at "
                 "TP=1 on the same preset in the same run, and the ratios are in checks (TP=N / TP=1 time per token, "
                 "agreement with TP=1)"}
AGREE_PROMPTS, AGREE_PROMPT_LEN, AGREE_GEN_LEN = 4, 64, 32
SPEED_PRESETS = ("llama-13b",)                           # agreement presets that also run the speed measurements


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def open_engine(preset: str, tp_size: int, cuda_graphs: bool = True, dtype: torch.dtype = DTYPE,
                all_reduce: str = "auto", invariant: bool = False):
    """The preset's bf16 weights (dtype=torch.float32: the same values, computed in fp32)."""
    start = time.perf_counter()
    engine = tierllm.init_inference(PresetSource(preset, DTYPE), dtype=dtype, device="cuda",
                                    enable_cuda_graph=cuda_graphs,
                                    tensor_parallel={"tp_size": tp_size, "timeout_s": 300, "all_reduce": all_reduce,
                                                     "invariant": invariant},
                                    max_model_len=1024,
                                    max_num_seqs=THROUGHPUT_BATCH, max_num_batched_tokens=4096, show_progress=False,
                                    gpu_memory_utilization=0.9)
    log(f"{preset} TP={tp_size}: engine up in {time.perf_counter() - start:.1f} s")
    return engine, time.perf_counter() - start


def free_memory() -> None:
    """After the last reference to a closed engine is gone: collect its cycles, return the cached blocks."""
    gc.collect()
    torch.cuda.empty_cache()


def next_tokens(engine, prefixes: list[list[int]]) -> list[int]:
    """Greedy next token after each prefix (left-padded batch, one new token)."""
    width = max(len(p) for p in prefixes)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prefixes])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
    return engine.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                           pad_token_id=0)[:, -1].tolist()


def share_equal(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def agreement_probe(engine, vocab: int, reference: dict | None) -> dict:
    """TP=1 (reference None): its continuations and its next token on every prefix of them. TP=N: the same
    questions, compared with TP=1's answers."""
    prompts = _random_prompts(AGREE_PROMPTS, AGREE_PROMPT_LEN, vocab, seed=99)
    continuations = engine.generate(prompts, max_new_tokens=AGREE_GEN_LEN, min_new_tokens=AGREE_GEN_LEN,
                                    do_sample=False)[:, AGREE_PROMPT_LEN:].tolist()
    base = reference["continuations"] if reference else continuations
    prefixes = [prompts[i].tolist() + base[i][:t] for i in range(AGREE_PROMPTS) for t in range(AGREE_GEN_LEN)]
    answers = next_tokens(engine, prefixes)
    out = {"continuations": continuations, "answers": answers, "prefixes": prefixes}
    if reference is None:
        # the noise floor of bf16 on flat random logits: the same TP=1 engine, the same questions in two half
        # batches (other GEMM shapes and padding, so other summation orders)
        half = len(prefixes) // 2
        again = next_tokens(engine, prefixes[:half]) + next_tokens(engine, prefixes[half:])
        out["self_agreement_other_batching"] = share_equal(answers, again)
    if reference:
        pairs = [(a, b) for ra, oa in zip(reference["continuations"], continuations, strict=True)
                 for a, b in zip(ra, oa, strict=True)]
        out["free_running_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        out["teacher_forced_agreement"] = share_equal(reference["answers"], answers)
    return out


def fp32_answers(preset: str, prefixes: list[list[int]], invariant: bool = False) -> list[int]:
    """TP=1 in fp32 on the same (bf16-valued) weights: the exact answers both bf16 engines are measured against. On
    near-flat random logits, how often bf16 TP=1 itself misses them is the noise any bf16 engine has."""
    engine, _ = open_engine(preset, 1, cuda_graphs=False, dtype=torch.float32, invariant=invariant)
    answers = next_tokens(engine, prefixes)
    engine.close()
    del engine
    free_memory()
    return answers


def decode_bytes(preset: str, tp_size: int) -> dict:
    """Bytes one batch-1 decode step reads on each rank: its weight shard (all but the embedding table; norms are
    replicated) and its KV heads at the average context of the latency run."""
    source = PresetSource(preset, DTYPE)
    config, element = source.config, torch.empty((), dtype=DTYPE).element_size()
    weights = 0
    for name, shape in source._shapes():
        numel = torch.Size(shape).numel()
        if "embed_tokens" in name:
            numel = numel if config.tie_word_embeddings else 0          # tied: the LM head reads it
        weights += numel * element // (1 if "norm" in name else tp_size)
    kv_heads = max(1, config.num_key_value_heads // tp_size)
    kv = _kv_bytes_per_token_of_context(config, DTYPE) * kv_heads // config.num_key_value_heads
    return {"weight_bytes_per_rank": weights, "kv_bytes_per_rank": int(kv * (PROMPT_LEN + LATENCY_GEN_LEN / 2))}


def speed(engine, preset: str, tp_size: int, hbm_GBps: float) -> dict:
    """Batch-1 latency against the aggregate HBM roofline (each rank reads its shard at one GPU's bandwidth,
    all ranks at once) and batch-64 throughput."""
    vocab = engine.engine.vocab_size
    _time_ours(engine, _random_prompts(1, PROMPT_LEN, vocab, 2).cuda(), 8)                      # warm-up
    latency = _time_ours(engine, _random_prompts(1, PROMPT_LEN, vocab, 1).cuda(), LATENCY_GEN_LEN)
    traffic = decode_bytes(preset, tp_size)
    roofline_ms = (traffic["weight_bytes_per_rank"] + traffic["kv_bytes_per_rank"]) / (hbm_GBps * 1e9) * 1e3
    latency.update(traffic, roofline_ms_per_token=round(roofline_ms, 3),
                   fraction_of_aggregate_roofline=round(roofline_ms / latency["decode_ms_per_step"], 4))
    # warm-up at the measured batch: a first batch-64 prefill autotunes its kernels (seen: 2.5 s cold, 1.5 warm)
    _time_ours(engine, _random_prompts(THROUGHPUT_BATCH, PROMPT_LEN, vocab, 3).cuda(), 4)
    throughput = _time_ours(engine, _random_prompts(THROUGHPUT_BATCH, PROMPT_LEN, vocab, 4).cuda(),
                            THROUGHPUT_GEN_LEN)
    log(f"{preset} TP={tp_size}: batch 1 {latency['decode_ms_per_step']:.2f} ms/token (roofline "
        f"{roofline_ms:.2f}), batch {THROUGHPUT_BATCH} {throughput['total_tok_s']:.0f} tok/s")
    table = batch1_kernel_table(engine, vocab)
    log(f"{preset} TP={tp_size}: rank 0's kernels, 16-token prompt + 16 graph-replayed decode steps\n{table}")
    return {"batch1": latency, f"batch{THROUGHPUT_BATCH}": throughput, "batch1_kernel_table_rank0": table}


def batch1_kernel_table(engine, vocab: int) -> str:
    """Where rank 0's batch-1 decode time goes (GEMVs vs all-reduces vs the rest), kernels inside the CUDA
    graphs included: a short prompt, so the decode steps dominate."""
    from torch.profiler import ProfilerActivity, profile

    prompt = _random_prompts(1, 16, vocab, 5).cuda()
    engine.generate(prompt, max_new_tokens=4, min_new_tokens=4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, max_new_tokens=17, min_new_tokens=17)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def parse_variant(spec: str, default_all_reduce: str) -> tuple[str, dict, str]:
    """'NAME:KEY=VALUE,...' -> (NAME, environment, all_reduce)."""
    name, _, pairs = spec.partition(":")
    env = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    all_reduce = env.pop("all_reduce", default_all_reduce)
    if not name or all_reduce not in ALL_REDUCE_KINDS:
        raise SystemExit(f"--variant {spec!r}: expected NAME:KEY=VALUE,... with all_reduce one of "
                         f"{', '.join(ALL_REDUCE_KINDS)}")
    return name, env, all_reduce


def all_reduce_running(engine) -> str:
    """The all-reduce rank 0 really has (symm_mem and fused fall back to NCCL's, with a warning, where they fail)."""
    parallel = engine.engine.runner.parallel
    if parallel.fused_all_reduce is not None:
        return "fused"
    return "symm_mem" if parallel.symm_all_reduce is not None else "nccl"


def restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def smollm2_135m_error() -> str:
    from tierllm.bench.presets import preset_config
    from tierllm.models.llama import LlamaForCausalLM
    try:
        LlamaForCausalLM.check_tp_size(preset_config("smollm2-135m"), 2)
    except ValueError as exc:
        return str(exc)
    return "no error"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-sizes", default="1,2", help="comma list; must start with 1 (the reference)")
    parser.add_argument("--skip-70b", action="store_true", help="leave out the llama-70b TP=4 run")
    parser.add_argument("--presets", default="smollm2-1.7b,llama-13b",
                        help="comma list of the agreement presets (llama-13b also runs the speed measurements); one "
                             "per call keeps a call inside the device's 10-minute limit; 'none': only the llama-70b run")
    parser.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false",
                        help="skip the TP=1 fp32 engine that gives every bf16 engine's agreement with exact answers")
    parser.add_argument("--all-reduce", default="auto", choices=ALL_REDUCE_KINDS,
                        help="the TP engines' all-reduce (tensor_parallel's all_reduce)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="repeatable: one llama-13b engine per variant at each TP size > 1, with these environment "
                             "variables (inherited by its workers) and all_reduce=nccl|symm_mem|fused; e.g. "
                             "sm:all_reduce=symm_mem (a second symm_mem or fused engine in one process gets NCCL: "
                             "the row's all_reduce_running says which one ran)")
    parser.add_argument("--invariant", action="store_true",
                        help="every engine with tensor_parallel invariant=True (TP=1 included): agreement only, no "
                             "speed runs")
    args = parser.parse_args()
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if tp_sizes[0] != 1 or max(tp_sizes) > torch.cuda.device_count():
        parser.error(f"--tp-sizes must start with 1 and need at most {torch.cuda.device_count()} GPUs here")
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    started = time.perf_counter()
    ceilings = {"hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1), "bf16_matmul_TFLOPs": round(matmul_TFLOPs(), 1),
                "num_gpus": torch.cuda.device_count()}
    gc.collect()
    torch.cuda.empty_cache()
    hbm = ceilings["hbm_copy_GBps(read+write)"]
    log(f"ceilings on GPU 0: {ceilings}")
    results: dict = {"smollm2-135m_tp2_error": smollm2_135m_error()}
    checks = []
    name = ("tp-" + "-".join(map(str, tp_sizes)) + "-" + args.presets.replace(",", "-")
            + ("" if args.all_reduce == "auto" else "-" + args.all_reduce.replace("_", "-"))
            + ("-variants" if args.variant else "")
            + ("-invariant" if args.invariant else "") + ".json")
    settings = {"dtype": "bfloat16", "tp_sizes": tp_sizes, "prompt_len": PROMPT_LEN, "latency_gen_len": LATENCY_GEN_LEN,
                "throughput": f"batch {THROUGHPUT_BATCH} x {PROMPT_LEN} prompt + {THROUGHPUT_GEN_LEN} new",
                "agreement": f"{AGREE_PROMPTS} prompts x {AGREE_PROMPT_LEN} tokens, {AGREE_GEN_LEN} new, greedy",
                "cuda_graphs": "on for the speed runs (llama-13b, llama-70b), off for agreement-only presets",
                "max_num_seqs": THROUGHPUT_BATCH, "all_reduce": args.all_reduce, "invariant": args.invariant}
    speed_presets = () if args.invariant else SPEED_PRESETS
    variants = [parse_variant(spec, args.all_reduce) for spec in args.variant]
    if variants:
        settings["variants"] = {label: {**env, "all_reduce": all_reduce} for label, env, all_reduce in variants}
    for preset in [p for p in args.presets.split(",") if p != "none"]:
        reference, exact = None, None
        runs = [(tp_size, variant) for tp_size in tp_sizes
                for variant in (variants if tp_size > 1 and variants and preset in speed_presets else [None])]
        for tp_size, variant in runs:
            name_suffix, env, all_reduce = variant or ("", {}, args.all_reduce)
            saved_env = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            # graph capture takes most of an engine's start; only the speed runs need it (the kernels are the same)
            engine, init_s = open_engine(preset, tp_size, cuda_graphs=preset in speed_presets, all_reduce=all_reduce,
                                         invariant=args.invariant)
            row = {"init_s": round(init_s, 1), "cuda_graphs": preset in speed_presets,
                   "all_reduce_running": all_reduce_running(engine)}
            if variant:
                row["variant"] = {**env, "all_reduce": all_reduce}
            probe_out = agreement_probe(engine, engine.engine.vocab_size, reference)
            if exact is not None:
                row["teacher_forced_agreement_vs_fp32"] = round(share_equal(probe_out["answers"], exact), 4)
            if reference is None:
                reference = probe_out
                row["self_agreement_other_batching"] = round(probe_out["self_agreement_other_batching"], 4)
                log(f"{preset} TP=1: {row}")
            else:
                row["free_running_agreement"] = round(probe_out["free_running_agreement"], 4)
                row["teacher_forced_agreement"] = round(probe_out["teacher_forced_agreement"], 4)
                checks.append(check(f"{preset} TP={tp_size}{' ' + name_suffix if name_suffix else ''} vs TP=1: "
                                    f"teacher-forced greedy agreement (bf16{', invariant' if args.invariant else ''})",
                                    probe_out["teacher_forced_agreement"], ">=", 0.95))
                log(f"{preset} TP={tp_size}: agreement {row}")
            if preset in speed_presets:
                row.update(speed(engine, preset, tp_size, hbm))
            results[f"{preset}_tp{tp_size}{'_' + name_suffix if name_suffix else ''}"] = row
            # written after every engine, before closing it: a call cut short still returns what it measured
            write_result(out_dir / name, "tensor_parallel", torch.device("cuda"), ceilings, PEERS, results, checks,
                         {**settings, "wall_s": round(time.perf_counter() - started)})
            close_started = time.perf_counter()
            engine.close()
            del engine                                  # the only reference: the next engine needs its memory
            free_memory()
            log(f"{preset} TP={tp_size}: closed in {time.perf_counter() - close_started:.1f} s")
            restore_env(saved_env)
            if tp_size == 1 and args.fp32_reference:
                exact = fp32_answers(preset, reference["prefixes"], args.invariant)
                results[f"{preset}_tp1"]["teacher_forced_agreement_vs_fp32"] = round(
                    share_equal(reference["answers"], exact), 4)
                log(f"{preset} TP=1 fp32: bf16 TP=1 picks the fp32 token on "
                    f"{results[f'{preset}_tp1']['teacher_forced_agreement_vs_fp32']:.1%} of prefixes")
    if "batch1" in results.get("llama-13b_tp1", {}):
        tp1_ms = results["llama-13b_tp1"]["batch1"]["decode_ms_per_step"]
        for key in [k for k in results if k.startswith("llama-13b_tp2")]:
            checks.append(check(f"llama-13b batch 1: time per token TP=2{key[len('llama-13b_tp2'):]} / TP=1",
                                results[key]["batch1"]["decode_ms_per_step"] / tp1_ms, "<=", 0.58))
    if 4 in tp_sizes and not args.skip_70b:
        engine, init_s = open_engine("llama-70b", 4, all_reduce=args.all_reduce)
        results["llama-70b_tp4"] = {"init_s": round(init_s, 1), "all_reduce_running": all_reduce_running(engine),
                                    **speed(engine, "llama-70b", 4, hbm)}
        checks.append(check("llama-70b TP=4 batch 1: fraction of the aggregate HBM roofline (4 GPUs)",
                            results["llama-70b_tp4"]["batch1"]["fraction_of_aggregate_roofline"], ">=", 0.75))
        write_result(out_dir / name, "tensor_parallel", torch.device("cuda"), ceilings, PEERS, results, checks,
                     {**settings, "wall_s": round(time.perf_counter() - started)})
        engine.close()
    settings["wall_s"] = round(time.perf_counter() - started)
    write_result(out_dir / name, "tensor_parallel", torch.device("cuda"), ceilings, PEERS, results, checks, settings)
    print_checks(checks)
    print(f"wrote {out_dir / name} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
