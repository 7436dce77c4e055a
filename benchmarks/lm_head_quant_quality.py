"""What quantizing the LM head would cost in quality, before building it: SmolLM2-135M's perplexity (the quality
test's text and windows: tests/quant/test_perplexity.py) with its head's weight replaced by its int8 (per output
channel) or int4 (group 64, round to nearest) round trip, on the fp32 body and on the int4 GPTQ body. The head is
untied for this (the embedding keeps its weight).

Why: at batch 1 the bf16 LM head of llama-7b reads 262 MB per token, ~61 us of int4's ~1.77 ms step on an H200
(benchmarks/notes/gpu-decode.md); int8 would halve that, int4 quarter it.

    python benchmarks/lm_head_quant_quality.py [--out benchmarks/results/lm-head-quant-quality-cpu.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierllm import init_inference  # noqa: E402
from tierllm.bench.perplexity import perplexity  # noqa: E402
from tierllm.bench.results import print_checks, write_result  # noqa: E402
from tierllm.config import QuantConfig  # noqa: E402
from tierllm.quant.formats import dequantize_int4, dequantize_int8  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

TEXT = ROOT / "tests" / "data" / "alice_chapters_1-3.txt"
BODIES = {"fp32": None, "int4-g64-gptq": QuantConfig(bits=4, method="gptq")}
HEADS = {"dense": None, "int8": QuantConfig(bits=8), "int4-g64": QuantConfig(bits=4)}
# a quality measurement: its baselines (the dense head, the fp32 body) run in the same call
NO_CEILING = {"note": "quality, not speed: no physical ceiling; the baseline is each body with its dense head"}
NO_PEER = {"note": "no peer engine: the same model with the head in the model dtype is the reference"}
INT8_HEAD_LIMIT = 0.01            # an int8 head within int8 weights' own bound (issue #5: +1% over fp32)


def round_trip_head(model, quant: QuantConfig) -> None:
    """The model's LM head weight replaced by its quantize -> dequantize round trip (untied from the embedding)."""
    head = model.lm_head
    weight = head.dense_weight.detach()
    packed = quantize_weight(weight, quant)
    if quant.bits == 8:
        dense = dequantize_int8(packed["qweight"], packed["scales"], torch.float32)
    else:
        dense = dequantize_int4(packed["qweight"], packed["scales"], packed.get("mins"), quant.group_size,
                                torch.float32)
    head.tied_embedding = None
    head.weight = torch.nn.Parameter(dense.to(weight.dtype), requires_grad=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lm-head-quant-quality-cpu.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)                     # as the quality test
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierllm.default_model import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokens = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).encode(TEXT.read_text())
    results = {}
    for body_name, body in BODIES.items():
        for head_name, head in HEADS.items():
            start = time.perf_counter()
            engine = init_inference(hf, quant=body, max_model_len=512, num_kv_blocks=8, show_progress=False)
            if head is not None:
                round_trip_head(engine.model, head)
            ppl = perplexity(engine.model, tokens, window=512)
            results.setdefault(body_name, {})[head_name] = round(ppl, 4)
            print(f"{body_name} body, {head_name} head: perplexity {ppl:.4f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            del engine
    fp32 = results["fp32"]["dense"]
    increase = {body: {head: round(ppl / fp32 - 1, 5) for head, ppl in heads.items()}
                for body, heads in results.items()}
    checks = [{"name": f"{body} body: int8 head perplexity / dense head - 1", "op": "<=", "target": INT8_HEAD_LIMIT,
               "value": round(heads["int8"] / heads["dense"] - 1, 5),
               "passed": heads["int8"] / heads["dense"] - 1 <= INT8_HEAD_LIMIT} for body, heads in results.items()]
    print_checks(checks)
    write_result(args.out, "lm_head_quant_quality", torch.device("cpu"), NO_CEILING, NO_PEER,
                 {"perplexity": results, "increase_over_fp32": increase, "tokens": len(tokens)}, checks,
                 {"model": path.name, "text": TEXT.name, "window": 512, "bodies": list(BODIES), "heads": list(HEADS)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
