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


def plot_offload_throughput(result_path: Path, png_path: Path) -> None:
    """Total tokens/s vs batch size per offload configuration (like ZeRO-Inference's throughput-latency table):
    tierllm with every layer streamed from pinned CPU memory, with the KV cache in CPU memory too (at a fixed GPU
    budget, where KV on the GPU caps the batch), from NVMe, and the peers; plus the PCIe-floor throughput."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(result_path).read_text())
    res = doc["results"]
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    cpu = res.get("cpu")
    if cpu:
        rows = cpu["tierllm"]
        ax.plot([r["batch"] for r in rows], [r["total_tok_s"] for r in rows], "o-",
                label="tierllm, layers in pinned CPU memory")
        floor = [r["batch"] / cpu["pcie_floor_s"] for r in rows]          # one decode step per PCIe-floor time
        ax.plot([r["batch"] for r in rows], floor, "--", color="gray", label="decode at the PCIe floor")
        for name, marker in (("deepspeed", "s"), ("accelerate", "^")):
            peer = [p for p in cpu["peers"] if p["peer"] == name and "total_tok_s" in p]
            if peer:
                ax.plot([p["batch"] for p in peer], [p["total_tok_s"] for p in peer], marker + "-",
                        label={"deepspeed": "DeepSpeed ZeRO-Inference (offload_param cpu)",
                               "accelerate": "accelerate cpu_offload"}[name])
    kv = res.get("kv")
    if kv:
        for name, marker, label in (("kv_on_gpu", "D", f"tierllm, {kv['gpu_budget']} GPU budget, KV on GPU"),
                                    ("kv_offload", "P", f"tierllm, {kv['gpu_budget']} GPU budget, KV offload")):
            ax.plot([kv[name]["batch"]], [kv[name]["total_tok_s"]], marker, markersize=9, label=label)
    nvme = res.get("nvme")
    if nvme:
        ax.plot([nvme["run"]["batch"]], [nvme["run"]["total_tok_s"]], "X", markersize=9,
                label=f"tierllm, layers on NVMe (gen {nvme['run']['gen_len']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("total tokens / s")
    ax.set_title(f"{res['preset']} bf16, every decoder layer offloaded — {doc['device']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
