"""PNG plots from benchmark JSON files."""
from __future__ import annotations

import json
from pathlib import Path


def plot_gpu_throughput(result_path: Path, png_path: Path) -> None:
    """Total tokens/s vs batch size: tierllm, HF eager, and the machine's ceiling for the same work (prefill at
    the measured matmul rate + decode steps at the HBM roofline)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(result_path).read_text())
    res = doc["results"]
    ours = res["throughput"]
    hf = res["hf_eager"]["throughput"]
    batches = [r["batch"] for r in ours]
    ceiling = [r["ceiling_total_tok_s"] for r in ours]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(batches, [r["total_tok_s"] for r in ours], "o-", label="tierllm (total tok/s)")
    ax.plot([r["batch"] for r in hf], [r["total_tok_s"] for r in hf], "s-", label="HF transformers eager")
    ax.plot(batches, ceiling, "--", color="gray", label="ceiling: matmul-rate prefill + HBM-roofline decode")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{res['preset']} bf16, prompt {ours[0]['prompt_len']}, gen {ours[0]['gen_len']} — {doc['device']}",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
