"""The persistent int4 layer chain (tierllm/kernels/int4_layer_chain.py) against the separate kernels it would
replace: per layer, o_proj into the residual, the post-attention norm with gate/up and silu, down into the residual,
the next layer's norm with qkv, batch 1, llama-7b's shapes (int4 group 64, asymmetric, random codes), LAYERS
layers of their own weights (3.6 GB: nothing stays in L2), in CUDA graphs.

- separate: w4_gemv_triton's kernels as decode launches them (each GEMV after int4_prepared_x's kernel, with PDL),
  at the graph tuner's picks (a carried .tuning cache spares the timing);
- chain: one launch per layer (after one memset of every layer's counters), at each --chain config;
- barrier: the chain's device-wide barrier alone, 8 rounds in one launch against 1, at the resident grid.

Also the floor: the layer's weight bytes at the copy rate measured in the same run. Correctness: layer 0's outputs
of both against the dequantized fp32 reference, and the chain's last layer against the separate path's.

    python benchmarks/int4_chain_ab.py [--layers 32] [--chain 4x32w8,4x32w8r80] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

from tierllm.bench.probe import hbm_copy_GBps
from tierllm.bench.results import write_result

HIDDEN, INTER, QKV, GROUP = 4096, 11008, 12288, 64
EPS = 1e-5


def _random_int4(n: int, k: int, gen: torch.Generator) -> dict:
    """Random codes with scales and mins of a trained layer's size (group 64, asymmetric)."""
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    scales = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 2e-3 + 5e-4).half()
    mins = -8 * scales * (1 + 0.1 * torch.randn(n, k // GROUP, device="cuda", generator=gen)).half()
    return {"qweight": qweight, "scales": scales, "mins": mins}


def _layers(count: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [{"o": _random_int4(HIDDEN, HIDDEN, gen), "gate_up": _random_int4(2 * INTER, HIDDEN, gen),
             "down": _random_int4(HIDDEN, INTER, gen), "qkv": _random_int4(QKV, HIDDEN, gen),
             "g_post": (1 + 0.2 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16(),
             "g_next": (1 + 0.2 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16()}
            for _ in range(count)]


def _layer_bytes(layer: dict) -> int:
    return sum(t.nbytes for name in ("o", "gate_up", "down", "qkv") for t in layer[name].values())


def _separate(layer: dict, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The separate kernels: attn [1, H], h [1, H] (updated in place) -> qkv [1, QKV]."""
    from tierllm.kernels.quant_gemv import w4_gemv_triton

    def linear(x, name, **fusions):
        w = layer[name]
        return w4_gemv_triton(x, w["qweight"], w["scales"], w["mins"], GROUP, eps=EPS, pdl=True, **fusions)

    linear(attn, "o", residual=h)
    act = linear(h, "gate_up", norm_weight=layer["g_post"], gated=True)
    linear(act, "down", residual=h)
    return linear(h, "qkv", norm_weight=layer["g_next"])


def _reference(layer: dict, attn: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32: (h after the layer, qkv)."""
    from tierllm.quant.formats import dequantize_int4

    def dense(name):
        w = layer[name]
        return dequantize_int4(w["qweight"], w["scales"], w["mins"], GROUP, torch.float32)

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean() + EPS) * g.float()

    h = h.float().reshape(-1) + dense("o") @ attn.float().reshape(-1)
    gu = dense("gate_up") @ rms(h, layer["g_post"])
    h = h + dense("down") @ (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:])
    return h, dense("qkv") @ rms(h, layer["g_next"])


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().reshape(-1) - ref.double().reshape(-1)).norm() / ref.double().norm()).item()


def _graph_us(run, replays: int = 20) -> float:
    """Median microseconds of one replay of a CUDA graph of run()."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _parse_chain(spec: str) -> dict:
    """'4x32w8' or '4x32w8r80' -> block_n 4, 32 groups per block, 8 warps (, maxnreg 80)."""
    rows, rest = spec.split("x")
    groups, rest = rest.split("w")
    warps, _, regs = rest.partition("r")
    return {"block_n": int(rows), "groups_per_block": int(groups), "num_warps": int(warps),
            "maxnreg": int(regs) if regs else None}


def _barrier_us(grid: int, launches: int = 16) -> dict:
    """One device-wide barrier: launches of 8 rounds against launches of 1, at `grid` programs of 8 warps
    (`launches` per graph, each on its own counters)."""
    import triton
    import triton.language as tl

    from tierllm.kernels.int4_layer_chain import PHASES, _arrive, _wait

    @triton.jit
    def rounds_kernel(counter_ptr, ROUNDS: tl.constexpr):
        for r in tl.static_range(ROUNDS):
            _arrive(counter_ptr, r, True)
            _wait(counter_ptr, r, True)

    counters = torch.zeros(launches, PHASES + 1, dtype=torch.int32, device="cuda")
    out = {}
    for rounds in (1, 8):
        def run(rounds=rounds):
            counters.zero_()
            for i in range(launches):
                rounds_kernel[(grid,)](counters[i], ROUNDS=rounds, num_warps=8)
        out[rounds] = _graph_us(run, replays=30) / launches
    failed = bool(counters[:, PHASES].any().item())
    return {"grid": grid, "launch_1_round_us": round(out[1], 2), "launch_8_rounds_us": round(out[8], 2),
            "per_barrier_us": round((out[8] - out[1]) / 7, 3), "failed": failed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chain", default="4x32w8,4x32w8r80,4x32w8r64")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results"))
                        / "int4-chain-ab.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tierllm.kernels.int4_layer_chain import PHASES, ChainBuffers, chain_failed, chain_layer

    copy_GBps = hbm_copy_GBps()
    layers = _layers(args.layers)
    layer_bytes = _layer_bytes(layers[0])
    floor_us = layer_bytes / (copy_GBps * 1e9) * 1e6
    gen = torch.Generator(device="cuda").manual_seed(1)
    attn = torch.randn(1, HIDDEN, device="cuda", generator=gen).bfloat16()
    h0 = (4 * torch.randn(1, HIDDEN, device="cuda", generator=gen)).bfloat16()
    results: dict = {"layer_weight_bytes": layer_bytes, "floor_us_per_layer": round(floor_us, 2)}

    # correctness, layer 0: both against fp32
    h_ref, qkv_ref = _reference(layers[0], attn, h0)
    h = h0.clone()
    qkv = _separate(layers[0], attn, h)
    results["separate_layer0_rel_err"] = {"h": _rel(h, h_ref), "qkv": _rel(qkv, qkv_ref)}
    buffers = ChainBuffers(HIDDEN, INTER, attn.device, attn.dtype)
    counters = torch.zeros(args.layers, PHASES + 1, dtype=torch.int32, device="cuda")
    qkv_chain = torch.empty(QKV, dtype=attn.dtype, device="cuda")

    def chain_all(config: dict, grid: int | None, count: int = args.layers, h_run: torch.Tensor | None = None):
        counters.zero_()
        for i in range(count):
            layer = layers[i]
            chain_layer(attn.view(-1), h_run.view(-1), qkv_chain, layer["o"], layer["gate_up"], layer["down"],
                        layer["qkv"], layer["g_post"], layer["g_next"], counters[i], buffers, GROUP, EPS,
                        grid=grid, **config)

    # separate path, all layers (its first run tunes outside the graph)
    h_sep = h0.clone()

    def separate_all():
        out = None
        for layer in layers:
            out = _separate(layer, attn, h_sep)
        return out

    separate_us = _graph_us(separate_all) / args.layers
    results["separate_us_per_layer"] = round(separate_us, 2)
    print(f"floor {floor_us:.2f} us/layer ({layer_bytes / 1e6:.1f} MB at {copy_GBps:.0f} GB/s); "
          f"separate {separate_us:.2f} us/layer; layer-0 errors {results['separate_layer0_rel_err']}", flush=True)

    chains = []
    for spec in args.chain.split(","):
        config = _parse_chain(spec)
        row = {"config": spec}
        try:
            h = h0.clone()
            chain_all(config, None, 1, h)
            torch.cuda.synchronize()
            row["layer0_rel_err"] = {"h": _rel(h, h_ref), "qkv": _rel(qkv_chain, qkv_ref)}
            row["failed_barrier"] = chain_failed(counters)
            h_run = h0.clone()
            row["us_per_layer"] = round(_graph_us(lambda c=config, h=h_run: chain_all(c, None, h_run=h)) / args.layers,
                                        2)
            row["failed_barrier"] = row["failed_barrier"] or chain_failed(counters)
            # the last layer of a full run against the separate path's from the same start
            h_a, h_b = h0.clone(), h0.clone()
            chain_all(config, None, h_run=h_a)
            for layer in layers:
                last = _separate(layer, attn, h_b)
            row["vs_separate_after_all_layers"] = {"h": _rel(h_a, h_b), "qkv": _rel(qkv_chain, last)}
        except Exception as error:                   # a config that does not compile or fit: recorded, the rest run
            row["error"] = f"{type(error).__name__}: {error}"[:400]
        chains.append(row)
        print(row, flush=True)
    results["chain"] = chains
    from tierllm.kernels.int4_layer_chain import _RESIDENT
    results["chain_grids"] = sorted({grid for grid in _RESIDENT.values()})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results["barrier"] = [_barrier_us(sms * per_sm) for per_sm in (1, 2, 4)]
    print("barrier:", results["barrier"], flush=True)
    write_result(args.out, "int4-chain-ab", torch.device("cuda"), {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: an A/B of two kernel designs of this project"}, results, [],
                 {"layers": args.layers, "shapes": {"hidden": HIDDEN, "inter": INTER, "qkv": QKV, "group": GROUP}})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
