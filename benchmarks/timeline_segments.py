"""Where a decode layer's time goes, from the raw kernel timelines that fused_ab.py writes (timeline-*.json: rank 0's
[start_us, duration_us, name] per kernel, sorted by start). Each decode layer runs QKV GEMV, rotary, decode split,
merge, o_proj, gate/up GEMV, down_proj (o_proj and down_proj are the fused GEMV all-reduce at TP > 1); a segment
runs from the end of the kernel before it to its own end, so a kernel launched early by programmatic dependent
launch counts only from there (benchmarks/notes/tp-history.md). Medians over all layers of the file, in us.

    python benchmarks/timeline_segments.py timeline-tp1-tp1.json timeline-new-tp2.json

--kernels: per kernel instead, for any decode chain (int4's preparing kernels, HELD, bf16's fused GEMVs): the layers
cut after each decode split kernel, each kernel's segment, medians over the layers that ran the most common kernel
sequence (quant_gpu.py's timeline-*-b1-long.json files).

    python benchmarks/timeline_segments.py --kernels timeline-bf16-b1-long.json timeline-int4-b1-long.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

SEGMENTS = ("attention", "o_proj", "gate_up", "down_proj", "qkv", "layer")


def layer_segments(kernels: list) -> dict[str, float]:
    """Median segment lengths (us) over the layers found in one timeline."""
    ends = [start + duration for start, duration, _ in kernels]
    names = [name for _, _, name in kernels]
    found: dict[str, list[float]] = {key: [] for key in SEGMENTS}
    for i, name in enumerate(names):
        # rotary at i: QKV i-1, split i+1, merge i+2, o_proj i+3, gate/up i+4, down i+5, the next layer's QKV i+6
        if not name.startswith("_rotary") or i < 1 or i + 6 >= len(names) or "split" not in names[i + 1]:
            continue
        if not names[i + 6].startswith("_gemv_body"):
            continue                                             # the last layer: the LM head follows
        qkv_end, merge_end = ends[i - 1], ends[i + 2]
        found["attention"].append(merge_end - qkv_end)
        found["o_proj"].append(ends[i + 3] - merge_end)
        found["gate_up"].append(ends[i + 4] - ends[i + 3])
        found["down_proj"].append(ends[i + 5] - ends[i + 4])
        found["qkv"].append(ends[i + 6] - ends[i + 5])
        found["layer"].append(ends[i + 6] - qkv_end)
    return {key: round(statistics.median(values), 1) if values else float("nan") for key, values in found.items()} | {
        "layers": len(found["layer"])}


def kernel_segments(kernels: list) -> tuple[list[tuple[str, float]], int]:
    """[(kernel name, median segment in us)] over one layer, from a decode split kernel's end to the next one's, for
    the most common kernel sequence among the layers of one timeline, and how many layers ran it."""
    ends = [start + duration for start, duration, _ in kernels]
    names = [name for _, _, name in kernels]
    splits = [i for i, name in enumerate(names) if "_decode_split_kernel" in name]
    layers: dict[tuple, list[list[float]]] = {}
    for a, b in zip(splits, splits[1:], strict=False):
        sequence = tuple(names[a + 1:b + 1])
        layers.setdefault(sequence, []).append([ends[j] - ends[j - 1] for j in range(a + 1, b + 1)])
    sequence, segments = max(layers.items(), key=lambda item: len(item[1]))
    medians = [statistics.median(column) for column in zip(*segments, strict=True)]
    return list(zip(sequence, medians, strict=True)), len(segments)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", action="store_true", help="per kernel of any decode chain, not per segment")
    parser.add_argument("paths", nargs="+", help="timeline JSON files (kernel_timeline's [start, us, name] lists)")
    args = parser.parse_args(argv)
    timelines = {}
    for path in args.paths:
        try:
            with open(path) as handle:
                timelines[path] = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"{path}: {error} (give kernel_timeline's JSON files)")
    if args.kernels:
        for path, timeline in timelines.items():
            segments, count = kernel_segments(timeline)
            print(f"{path}: {count} layers, {sum(us for _, us in segments):.2f} us per layer")
            for name, us in segments:
                print(f"  {name[:48]:<48} {us:7.2f}")
        return 0
    print(f"{'file':<36}" + "".join(f"{key:>11}" for key in SEGMENTS) + f"{'layers':>8}")
    for path, timeline in timelines.items():
        row = layer_segments(timeline)
        print(f"{path[-36:]:<36}" + "".join(f"{row[key]:>11}" for key in SEGMENTS) + f"{row['layers']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
