"""A decode layer as the two tensor-core block kernels chained with PDL (int4_mma_attention_block_probe's attention
block, then int4_mma_mlp_block_probe's MLP block) against the engine's chain of the same layer, in one run: does
the sum of the blocks' savings hold when they follow each other?

Why: the two probes each time their block against its part of the engine's chain (the attention block 21.3 against
25.7 us, the MLP block 24.5 against 27.0; benchmarks/notes/gpu-decode.md, sessions 49-50), and the projection to a
token adds the two savings. But each block kernel holds all of an SM's shared memory, so the next one cannot start
before it drains: the boundary between them may cost more than the engine's boundary between two small kernels.

Timed per layer over LAYERS copies of every weight and KV cache (chained in one CUDA graph, PDL throughout):
- blocks: the attention block then the MLP block, each at its best config;
- engine: the attention chain (qkv's preparing kernel and HELD with the norm and rotary epilogue, the split
  attention and merge, XHALF's o) then the MLP chain (HELD's gate/up after its preparing kernel, XHALF's down);
- each of the four alone, in the same run.
The chain's data flow is not the layer's (each block reads its own h), which the kernels' timing does not depend on;
each block's outputs are checked in its own probe.

--switch times what a change of kernel costs at these kernels' boundaries: the attention block chained with itself,
with a second compilation of itself (its CUDA-core form), with the MLP block, and with an empty kernel (one CTA per
SM that only lets its successor launch and waits), each pair per layer copy, against each kernel's chain alone.

    python benchmarks/int4_mma_layer_chain_probe.py [--attention STAGES:W:S:AW[:KS_O][t]] [--mlp STAGES:W] [--switch]
        [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_mma_attention_block_probe import HAS_GLUON  # noqa: E402
from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels._dispatch import HAS_TRITON  # noqa: E402

LAYERS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_start

    @triton.jit
    def _empty_kernel(PDL: tl.constexpr):
        """Nothing but the PDL handshake: a different binary of almost no code."""
        pdl_start(PDL)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-mma-layer-chain-probe-h200.json")
    parser.add_argument("--attention", default="2:4:4:4t", help="the attention block's config")
    parser.add_argument("--mlp", default="2:8", help="the MLP block's config")
    parser.add_argument("--switch", action="store_true", help="time kernel changes at the blocks' boundaries instead")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    import int4_mma_attention_block_probe as attention
    import int4_mma_mlp_block_probe as mlp
    from int4_attention_block_probe import CONTEXT, HEAD_DIM, layer_state, stacked_weights
    from int4_mlp_block_probe import HELD_GATE_UP, block_setup
    from int4_mlp_block_probe import engine_chain as mlp_engine_chain

    copy_GBps, gate_ups, downs, mlp_inputs, mlp_floor_us = block_setup()
    gate_ups, downs = gate_ups[:LAYERS], downs[:LAYERS]
    gen = torch.Generator(device="cuda").manual_seed(2)
    weights = stacked_weights(attention.HEADS, attention.HIDDEN, LAYERS, gen, "cuda")
    state = layer_state(attention.HEADS, LAYERS, CONTEXT, gen, "cuda")
    att_inputs = attention.block_inputs(weights, state, gen)
    att_block = attention.Block(weights, state, attention.parse_config(args.attention))
    mlp_block = mlp.Block(gate_ups, downs, mlp.parse_config(args.mlp))
    h, norm = att_inputs["h"], att_inputs["norm"]
    mh, mnorm = mlp_inputs["h"], mlp_inputs["norm"]
    ys = [torch.zeros(1, attention.HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]

    def engine_attention(i: int) -> None:
        attention.engine_chain(weights[i], state["layers"][i], state, h, norm, attention.HELD_QKV[0], ys[i])

    def engine_mlp(i: int) -> None:
        mlp_engine_chain(gate_ups[i], downs[i], mh.view(1, -1), mlp_inputs["act"], "held")

    steps = {"attention_block": lambda i: att_block.launch(i, h, norm),
             "mlp_block": lambda i: mlp_block.launch(i, mh, mnorm),
             "engine_attention": engine_attention, "engine_mlp": engine_mlp}
    layers = list(range(LAYERS))
    if args.switch:
        return switch_costs(args, steps, attention.Block(weights, state, attention.parse_config(
            args.attention.rstrip("t"))), h, norm, layers, copy_GBps)
    result = {name: round(chained_us(step, layers), 2) for name, step in steps.items()}
    att_block.reset()
    mlp_block.reset()
    result["blocks_chained"] = round(chained_us(lambda i: (steps["attention_block"](i), steps["mlp_block"](i)),
                                                layers), 2)
    result["engine_chained"] = round(chained_us(lambda i: (engine_attention(i), engine_mlp(i)), layers), 2)
    result["blocks_alone_sum"] = round(result["attention_block"] + result["mlp_block"], 2)
    result["engine_alone_sum"] = round(result["engine_attention"] + result["engine_mlp"], 2)
    result["saving_chained_us"] = round(result["engine_chained"] - result["blocks_chained"], 2)
    result["saving_alone_sum_us"] = round(result["engine_alone_sum"] - result["blocks_alone_sum"], 2)
    result["blocks_over_engine_chained"] = round(result["blocks_chained"] / result["engine_chained"], 3)
    result["gave_up_waits"] = int(att_block.sync[1].item()) + int(mlp_block.sync[1].item())
    print(result)
    kv_bytes = 2 * (CONTEXT - 1) * attention.HEADS * HEAD_DIM * 2
    att_bytes = sum(t.nbytes for t in weights[0].values()) + kv_bytes
    write_result(args.out, "int4-mma-layer-chain-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "layer_floor_us": round(att_bytes / (copy_GBps * 1e9) * 1e6 + mlp_floor_us, 2),
                  "note": "the layer's int4 weights (qkv, o, gate/up, down) and a 543-token KV cache at the copy rate"},
                 {"note": "the engine's chain of the same layer in the same run (engine_chained; HELD qkv with the "
                          f"rotary epilogue at {attention.HELD_QKV[0]}, paged decode attention, XHALF o; HELD gate/up "
                          f"at {HELD_GATE_UP}, XHALF down)"},
                 result, [{"name": "no wait gave up in the blocks' chained launches", "value": result["gave_up_waits"],
                           "op": "==", "target": 0, "passed": result["gave_up_waits"] == 0}],
                 {"layers": LAYERS, "attention": args.attention, "mlp": args.mlp, "context": CONTEXT, "pdl": True})
    print(f"wrote {args.out}")
    return 0


def switch_costs(args, steps: dict, other_form, h: torch.Tensor, norm: torch.Tensor, layers: list,
                 copy_GBps: float) -> int:
    """The --switch run: per layer copy two launches, the attention block then itself, then its CUDA-core form (the
    same kernel compiled apart: another binary), then the MLP block, then an empty kernel, against each chain alone;
    twice."""
    runs = []
    attention_block, mlp_block = steps["attention_block"], steps["mlp_block"]
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    other = {"attention_block": attention_block, "attention_cuda_core_form": lambda i: other_form.launch(i, h, norm),
             "mlp_block": mlp_block,
             "empty_kernel": lambda i: _empty_kernel[(programs,)](PDL=True, num_warps=1, launch_pdl=True)}
    for _ in range(2):
        run = {f"{name}_alone": round(chained_us(step, layers), 2) for name, step in other.items()}
        for name, step in other.items():
            run[f"attention_block_then_{name}"] = round(chained_us(lambda i, step=step: (attention_block(i), step(i)),
                                                                   layers), 2)
            run[f"switch_cost_{name}_us"] = round(run[f"attention_block_then_{name}"] - run["attention_block_alone"]
                                                  - run[f"{name}_alone"], 2)
        runs.append(run)
        print(run)
    write_result(args.out, "int4-mma-layer-chain-probe-switch", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: each kernel's chain alone in the same run is the reference"}, {"runs": runs}, [],
                 {"layers": LAYERS, "attention": args.attention, "mlp": args.mlp, "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
