"""Serving on one GPU (llama-7b preset, bf16): Dynamic SplitFuse vs prefill-first scheduling under the same
mixed load (prompts 128-4096 tokens, outputs 32-256), and saturated server throughput vs offline generation of
the same requests. Servers run as `tierllm serve` subprocesses; the load generator runs here.
Usage: python benchmarks/serve_gpu.py TOKENIZER_DIR OUT_JSON [SPLITFUSE_TOKEN_BUDGET (default 384)]"""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import torch

import tierllm
from tierllm.bench.presets import build_preset_hf_model
from tierllm.bench.results import check, print_checks, write_result
from tierllm.bench.serve_bench import LoadSpec, plan_requests, run_load_sync

PRESET, VOCAB, MAX_LEN = "llama-7b", 32000, 4096      # Llama-2-7B holds 4096 positions
MIXED = dict(num_requests=100, prompt_len_range=(128, 3840), output_len_range=(32, 256), token_vocab=VOCAB, seed=0,
             ttft_slo_s=2.0, tpot_slo_s=0.1)
RATES = (3.0, 6.0, 10.0)           # offered loads (req/s), below and above saturation; the check uses the highest
# SplitFuse's budget: with its mixed steps replayed as CUDA graphs, a 384-token step (~25 ms with ~30 long decodes)
# keeps token gaps short; prefill-first must fit a whole 4096-token prompt
BUDGET = {"splitfuse": 384, "prefill_first": 8192}
MIXED_GRAPH_TOKENS = 512           # `tierllm serve`'s default: steps with up to 512 prompt tokens replay CUDA graphs


def start_server(tokenizer_dir: str, policy: str, budget: int):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), f"server-{policy}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "tierllm.cli", "serve", "--preset", PRESET, "--tokenizer",
                             tokenizer_dir, "--port", str(port), "--max-model-len", str(MAX_LEN), "--max-num-seqs",
                             "128", "--max-num-batched-tokens", str(budget), "--max-queue", "1024",
                             "--scheduler-policy", policy], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"server ({policy}) exited; see {log.name}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not start")


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def summary(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "requests"}


def offline_throughput(spec: LoadSpec) -> dict:
    """The same requests through the engine directly (each with its own max_tokens), all submitted at once."""
    hf = build_preset_hf_model(PRESET, torch.bfloat16, torch.device("cuda"))
    llm = tierllm.LLM(hf, dtype=torch.bfloat16, max_model_len=MAX_LEN, max_num_seqs=128,
                      max_num_batched_tokens=BUDGET["splitfuse"], mixed_graph_tokens=MIXED_GRAPH_TOKENS,
                      show_progress=False)
    del hf
    torch.cuda.empty_cache()
    engine = llm.engine
    planned = plan_requests(spec)
    for warm in planned[:4]:                                   # warm-up (not timed)
        engine.add_request(f"warm{warm.index}", warm.prompt, tierllm.SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for req in planned:
        engine.add_request(str(req.index), req.prompt, tierllm.SamplingParams(max_tokens=req.output_len,
                                                                              ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": round(seconds, 3), "output_throughput": round(tokens / seconds, 1)}


def main() -> None:
    tokenizer_dir, out_path = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:
        BUDGET["splitfuse"] = int(sys.argv[3])
    results = {}
    for policy, budget in BUDGET.items():
        base, proc = start_server(tokenizer_dir, policy, budget)
        try:
            run_load_sync(base, LoadSpec(request_rate=float("inf"), **{**MIXED, "num_requests": 8, "seed": 99}))
            for rate in RATES:
                results[f"{policy}_mixed_{rate:g}rps"] = summary(run_load_sync(base, LoadSpec(request_rate=rate,
                                                                                             **MIXED)))
            if policy == "splitfuse":
                results["splitfuse_saturated"] = summary(run_load_sync(base, LoadSpec(request_rate=float("inf"),
                                                                                       **MIXED)))
        finally:
            stop_server(proc)
        print(policy, "done", flush=True)
    results["offline"] = offline_throughput(LoadSpec(request_rate=float("inf"), **MIXED))
    high = f"{max(RATES):g}rps"
    sf, pf = results[f"splitfuse_mixed_{high}"], results[f"prefill_first_mixed_{high}"]
    # TPOT per token (every gap between streamed tokens, FastGen's token-level latency): a prefill stall shows
    # as the long gaps it is; the per-request mean spreads it over the request and is reported beside it
    results["per_request_mean_tpot_p95_ratio"] = round(pf["tpot_p95_s"] / sf["tpot_p95_s"], 3)
    checks = [check(f"p95 TPOT (token level) prefill-first / SplitFuse at {high}", pf["itl_p95_s"] / sf["itl_p95_s"],
                    ">=", 2.5),
              check("saturated server output tok/s / offline LLM output tok/s",
                    results["splitfuse_saturated"]["output_throughput"] / results["offline"]["output_throughput"],
                    ">=", 0.9)]
    settings = {"preset": PRESET, "dtype": "bfloat16", "offered_rates_req_s": list(RATES),
                **{k: str(v) for k, v in MIXED.items()}, "token_budgets": BUDGET, "max_num_seqs": 128,
                "mixed_graph_tokens": MIXED_GRAPH_TOKENS}
    from tierllm.bench.probe import probe
    write_result(__import__("pathlib").Path(out_path), "serve", torch.device("cuda"), probe(),
                 {"prefill_first_scheduling": pf}, results, checks, settings)
    for name, r in results.items():
        if not isinstance(r, dict) or name == "offline":
            continue
        print(f"{name:22s} ok {r['num_ok']:>4}  TTFT p50/p95 {r['ttft_p50_s']:.3f}/{r['ttft_p95_s']:.3f} s  "
              f"TPOT p50/p95 {r['tpot_p50_s'] * 1e3:.1f}/{r['tpot_p95_s'] * 1e3:.1f} ms  "
              f"token gaps p50/p95/p99 {r['itl_p50_s'] * 1e3:.1f}/{r['itl_p95_s'] * 1e3:.1f}/{r['itl_p99_s'] * 1e3:.1f} ms  "
              f"{r['output_throughput']:.0f} tok/s  effective {r['effective_throughput']:.2f} req/s")
    print("offline", results["offline"])
    print_checks(checks)


if __name__ == "__main__":
    main()
