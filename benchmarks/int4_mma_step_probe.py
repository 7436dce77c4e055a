"""Does a decode step's layers in one persistent kernel, launched once per token, reach the bytes where the blocks
chained as kernels did not? A Gluon probe on llama-7b's shapes at batch 1, int4 weights, all 32 layers.

Why: the attention block (int4_mma_attention_block_probe.py, 21.3 us) and the MLP block (int4_mma_mlp_block_probe.py,
24.5 us) each beat their part of the engine's chain alone, but chained as a layer they save 1.1 us of 7
(int4_mma_layer_chain_probe.py: a change between the two large binaries costs ~3-6 us a boundary), and each launch
still starts with a cold ring (~3 us to the first slot: the launch before holds the shared memory) and ends with a
drain. 2.8x bf16 asks ~42 us per layer (benchmarks/notes/gpu-decode.md, session 50) against the layer's 28.8 us of
bytes. Here one binary runs every layer: the ring never drains between phases or layers, and no kernel boundary
is left in the step.

The kernel is tierllm/kernels/int4_step.py's (its docstring: a CTA's partitions, the counters, the work buffer).
Here it runs on random weights repacked per tile (tierllm/kernels/int4_tiles.py) and random KV caches.

Timed in the same run: this kernel over the 32 layers (distinct weights and KV caches: 3.6 GB of int4 weights,
no L2 reuse), and the engine's chain of the same 32 layers (qkv's preparing kernel and HELD with the norm and rotary
epilogue, paged decode attention split and merge, XHALF's o; HELD's gate/up, XHALF's down; each after its preparing
kernel). Every layer's two deltas (attention and MLP) and cached k and v are checked against the fp32 reference
computed from the kernel's own input to that layer, on the first two launches and on the last after the timing.

Measured on an H200 (benchmarks/notes/gpu-decode.md, sessions 51-53): 41.87-42.08 us per layer at 2:4:4:4 (then
2:4:4:4lcs: counters polled by loads, two counter warps, the attention's chunks sized to the split) against 52.4-53.0
for the engine's chain in the same runs (0.796-0.803; bytes 28.6-29.0), every layer within 3.6e-3 of the reference;
46.4 at session 51's 2:4:4:4l; 41.85 with the CTAs of a TPC taking work ids k and k + programs / 2 (session 53).
--isolated: launches each after a plain kernel, as the engine's graph runs them. --trace: qkv and gate/up stream at
the copy rate, each item's products ~0.72 us against ~1.1 of bytes; ~16 us per layer are waits between phases (from
qkv's items to o's x ~6.5, all of y before gate/up ~3, down's tail ~5). L2 prefetches, waits on a K slice's rows,
down's items among gate/up's, groups of CTAs owning the MLP's chunks, deeper rings (--context 272), two consumer
warps per tile ("h"), four counter warps and the x loaders merging their o slice's heads ("m") were all slower or
no faster.

    python benchmarks/int4_mma_step_probe.py [--configs STAGES:W:S:AW,...] [--layers N] [--context TOKENS]
        [--trace] [--isolated] [--out PATH]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_attention_block_probe import BLOCK_SIZE, CONTEXT, relative_error  # noqa: E402
from int4_mma_ring_probe import HAS_GLUON  # noqa: E402
from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_step import (  # noqa: E402
    COUNTERS,
    DN_SLICES,
    GU_SLICES,
    HEAD_DIM,
    HEAD_TILES,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    ITEM_ITEMS,
    ITEM_ROWS,
    KS,
    O_SLICES,
    QKV_SLICES,
    TRACE_POINTS,
    WIDTH,
    Y_AT,
    Z_AT,
    work_id,
)
from tierllm.kernels.int4_tiles import GROUP, TILE  # noqa: E402

LAYERS = 32
EPS = 1e-5
CONFIGS = ["2:4:4:4"]

if HAS_GLUON:
    from triton.language.extra.cuda import globaltimer

    from tierllm.kernels.int4_step import attention_blocks, attention_chunks, launch_step, step_descriptors

    @triton.jit
    def _now(out_ptr, at):
        """The global timer (ns) into out[at]."""
        tl.store(out_ptr + at, globaltimer())


def parse_config(spec: str) -> dict:
    """STAGES:W:S:AW (ring slots, tiles of 16 rows per item and consumer warps, splits of the cached tokens per
    head, attention warps). Since session 53 the CTAs of a TPC take work ids k and k + programs / 2 ("p": 41.85 us
    per layer against 42.07 for program ids, chained; an isolated launch's layers 1349.9 us against 1381.4).
    Session 52's flags are fixed: counters polled by loads ("l"), two counter warps ("c"), the attention's chunks
    sized to the split ("s"); lost: one consumer warp per tile ("h"), the x loaders merging their o slice's heads
    ("m", session 53: 43.30 against 42.08)."""
    stages, tiles, splits, attention_warps = map(int, spec.split(":"))
    if tiles not in (4, 8):
        raise ValueError(f"{spec}: the consumers are 4 or 8 warps")
    return {"STAGES": stages, "W": tiles, "S": splits, "AW": attention_warps}


def step_weights(layers: int, gen: torch.Generator) -> dict:
    """layers random int4 layers: the attention's stacked [q; k; v; o] weights (int4_attention_block_probe's), gate/up
    and down (int4_tma_ring_probe's, with their int32 views), and the two norms' weights per layer (bf16 [layers,
    HIDDEN])."""
    from int4_attention_block_probe import stacked_weights
    from int4_tma_ring_probe import layer_weights

    mlp, _, _ = layer_weights(gen, layers, ("gate_up", "down"))
    return {"attention": stacked_weights(HEADS, HIDDEN, layers, gen, "cuda"), "gate_up": mlp["gate_up"],
            "down": mlp["down"],
            "attn_norm": (1 + 0.1 * torch.randn(layers, HIDDEN, device="cuda", generator=gen)).bfloat16(),
            "mlp_norm": (1 + 0.1 * torch.randn(layers, HIDDEN, device="cuda", generator=gen)).bfloat16()}


def stacked_state(layers: int, gen: torch.Generator, context: int = CONTEXT) -> dict:
    """int4_attention_block_probe's layer_state for layers layers, with every layer's K and V caches views of one
    tensor each ([layers, blocks, BLOCK_SIZE, HEADS, HEAD_DIM]), as the kernel's descriptors take them."""
    from int4_attention_block_probe import layer_state

    state = layer_state(HEADS, layers, context, gen, "cuda")
    for name in ("k_cache", "v_cache"):
        stacked = torch.stack([layer[name] for layer in state["layers"]])
        state[name] = stacked
        for index, layer in enumerate(state["layers"]):
            layer[name] = stacked[index]
    return state


class Step:
    """The kernel's launches over one config: descriptors over the stacked weights and caches, the buffers."""

    def __init__(self, weights: dict, state: dict, config: dict):
        from tierllm.kernels.int4_tiles import repacked, stored_gate_up, stored_o, stored_qkv

        self.config, self.state, self.weights = config, state, weights
        self.layers = len(weights["attention"])

        def stacked(packed: list) -> list:
            return [torch.cat([p[key] for p in packed]) for key in ("codes", "pairs")]

        self.kept = (stacked([stored_qkv(w, HEADS, HEAD_DIM) for w in weights["attention"]])   # the descriptors'
                     + stacked([stored_o(w, HEADS, HEAD_DIM) for w in weights["attention"]])
                     + stacked([stored_gate_up(w, INTERMEDIATE) for w in weights["gate_up"]])
                     + stacked([repacked(w) for w in weights["down"]]))
        self.descs = step_descriptors(self.kept, state["k_cache"], state["v_cache"], config["W"])
        self.chunks = attention_chunks(int(state["context_len"].max()), BLOCK_SIZE, config["S"], config["AW"])
        self.max_blocks = attention_blocks(self.chunks, config["AW"])
        self.programs = torch.cuda.get_device_properties(0).multi_processor_count
        if self.programs % math.lcm(QKV_SLICES, DN_SLICES):
            raise ValueError(f"{self.programs} SMs: the kernel needs a multiple of {math.lcm(QKV_SLICES, DN_SLICES)}")
        self.work = torch.zeros(2, self.layers, WIDTH, device="cuda", dtype=torch.float32)
        self.part = torch.zeros(self.layers, HEADS * (config["S"] * (HEAD_DIM + 2) + HEAD_DIM), device="cuda",
                                dtype=torch.float32)
        self.counts = torch.zeros(self.layers * COUNTERS * 32, device="cuda", dtype=torch.int32)
        self.sync = torch.zeros(2, device="cuda", dtype=torch.int32)
        self.trace = torch.zeros(self.programs, self.layers + ITEM_ROWS, len(TRACE_POINTS), device="cuda",
                                 dtype=torch.int64)

    def reset(self) -> None:
        """Counters, arrivals and buffers to zero before a series of launches (the waits that gave up stay)."""
        self.counts.zero_()
        self.sync[0].zero_()
        self.work.zero_()
        self.trace.zero_()

    @property
    def launches(self) -> int:
        """The launches run since the reset, from the CTAs' arrivals (a CUDA graph's replays launch without Python)."""
        return int(self.sync[0].item()) // self.programs

    def region(self, layer: int) -> torch.Tensor:
        """The last launch's work row of layer (its parity's)."""
        return self.work[(self.launches - 1) % 2, layer]

    def counts_as_expected(self) -> bool:
        """Every layer's counters at their items per launch times the launches since the reset; every CTA's arrival
        counted (whole launches of arrivals)."""
        chunk = [min(KS * GROUP, INTERMEDIATE - c * KS * GROUP) // 8 * GU_SLICES for c in range(DN_SLICES)]
        splits, per = self.config["S"], KS * GROUP // HEAD_DIM         # per: heads per o slice
        per_launch = ([HEAD_TILES * QKV_SLICES] * HEADS
                      + [splits] * HEADS + [per] * O_SLICES
                      + [HIDDEN // TILE // self.config["W"] * O_SLICES] + chunk
                      + [HIDDEN // TILE // self.config["W"] * DN_SLICES])
        counted = self.counts.view(self.layers, COUNTERS, 32)[:, :, 0]
        want = torch.tensor(per_launch, device="cuda", dtype=torch.int32) * self.launches
        return bool((counted == want).all()) and int(self.sync[0].item()) == self.launches * self.programs

    def launch(self, h: torch.Tensor, trace: bool = False) -> None:
        """One step from h (fp32 [HIDDEN]) through every layer."""
        state, config = self.state, self.config
        launch_step(self.descs, h, self.weights["attn_norm"], self.weights["mlp_norm"], state["cos"], state["sin"],
                    state["table"], state["context_len"], state["slot"], state["k_cache"], state["v_cache"], self.work,
                    self.part, self.counts, self.sync, self.trace, self.programs, EPS, self.max_blocks, self.chunks,
                    config["STAGES"], config["S"], config["AW"], config["W"], trace)


def layer_errors(step: Step, weights: dict, h: torch.Tensor) -> dict:
    """The last launch's layers against the fp32 reference, each layer from the kernel's own input to it: the worst
    relative error over the layers of the attention's delta (y - x), the MLP's (z - y), and the cached k and v."""
    from int4_attention_block_probe import block_reference
    from int4_mlp_block_probe import mlp_delta

    state, rows, slot = step.state, HEADS * HEAD_DIM, int(step.state["slot"])
    worst = {"attention": 0.0, "mlp": 0.0, "k_cached": 0.0, "v_cached": 0.0}
    x = h.float()
    for layer in range(step.layers):
        region = step.region(layer)
        y, z = region[Y_AT:Y_AT + HIDDEN], region[Z_AT:Z_AT + HIDDEN]
        normed = x * torch.rsqrt(x.pow(2).mean() + EPS) * weights["attn_norm"][layer].float()
        o, k_row, v_row = block_reference(normed.view(1, -1), weights["attention"][layer], state,
                                          state["layers"][layer], HEADS)
        cache = {name: state["layers"][layer][name].view(-1, rows)[slot] for name in ("k_cache", "v_cache")}
        mlp = mlp_delta(weights["gate_up"][layer], weights["down"][layer], y, weights["mlp_norm"][layer])
        for key, value in (("attention", relative_error(y - x, o.view(-1))), ("mlp", relative_error(z - y, mlp)),
                           ("k_cached", relative_error(cache["k_cache"], k_row)),
                           ("v_cached", relative_error(cache["v_cache"], v_row))):
            worst[key] = max(worst[key], value)
        x = z
    return worst


def trace_summary(trace: torch.Tensor) -> dict:
    """Per trace point, us after the launch's first loader stamp: the median over the CTAs per layer for the first two
    layers, a middle one and the last; the middle layer's latest CTA; the median period between layers."""
    start = trace[:, 0, 11][trace[:, 0, 11] > 0].min()        # the loaders' first stamps
    layers = trace.shape[1]
    summary = {}
    for column, name in enumerate(TRACE_POINTS):
        # (a stamp from an earlier launch stays where this one's CTA did not stamp: a head's merge moves)
        stamped = [(trace[:, layer, column][trace[:, layer, column] >= start] - start).double() / 1e3
                   for layer in range(layers)]
        medians = [float(us.median()) if us.numel() else None for us in stamped]
        known = [m for m in medians if m is not None]
        middle = stamped[layers // 2]
        summary[name] = {"layers_0_1_mid_last_us": [None if m is None else round(m, 2) for m in
                                                    (medians[0], medians[min(1, layers - 1)], medians[layers // 2],
                                                     medians[-1])],
                         "mid_latest_us": round(float(middle.max()), 2) if middle.numel() else None,
                         "median_period_us": (round(float(torch.tensor(known).diff().median()), 2)
                                              if len(known) > 2 else None)}
    return summary


def item_kinds(pid: int, programs: int, tiles: int) -> list[str]:
    """The kinds of a CTA's items per layer, in order (the kernel's _sequence on the host)."""
    kinds = []
    for kind, slices, quads in (("qkv", QKV_SLICES, HEADS * HEAD_TILES // tiles),
                                ("o", O_SLICES, HIDDEN // 16 // tiles),
                                ("gate/up", GU_SLICES, 2 * INTERMEDIATE // 16 // tiles),
                                ("down", DN_SLICES, HIDDEN // 16 // tiles)):
        s, r = pid % slices, pid // slices
        n = (programs - s + slices - 1) // slices
        kinds += [kind] * max(0, -(-(quads - r) // n))
    return kinds


def item_summary(trace: torch.Tensor, layers: int, tiles: int) -> dict:
    """The middle layer's first ITEM_ITEMS items per CTA (trace rows layers ..: SM clock stamps, ITEM_STAMPS each,
    then the clock and the timer at the consumers' start and end): the SM's clock rate (GHz, median over CTAs) and
    per kind the means over CTAs and items of the wait for the slot, the products and flush, the handoff, and the
    step to the next item's slot wait (us at the CTA's clock), and the median CTA's span from its first item's slot
    wait to its last item's handoff."""
    programs = trace.shape[0]
    flat = trace[:, layers:].reshape(programs, -1).double()
    stamps = flat[:, :ITEM_ITEMS * 4].view(programs, ITEM_ITEMS, 4)                      # [CTA, item, stamp] cycles
    clock0, timer0, clock1, timer1 = flat[:, ITEM_ITEMS * 4:ITEM_ITEMS * 4 + 4].unbind(1)
    ghz = (clock1 - clock0) / (timer1 - timer0)                                          # cycles per ns, per CTA
    parts = {}
    for pid in range(programs):
        kinds = item_kinds(work_id(pid, programs), programs, tiles)[:ITEM_ITEMS]
        for i, kind in enumerate(kinds):
            t = stamps[pid, i] / ghz[pid] / 1e3                                          # us
            after = stamps[pid, i + 1, 0] / ghz[pid] / 1e3 if i + 1 < len(kinds) and kinds[i + 1] == kind else None
            parts.setdefault(kind, []).append((t[1] - t[0], t[2] - t[1], t[3] - t[2],
                                               None if after is None else after - t[3], pid, t[0], t[3]))
    summary = {"sm_clock_GHz": round(float(ghz.median()), 3)}
    for kind, rows in parts.items():
        spans = {}
        for *_, pid, first, last in rows:
            begin, end = spans.get(pid, (first, last))
            spans[pid] = (min(begin, first), max(end, last))

        def mean(c: int, rows=rows) -> float:
            values = [float(row[c]) for row in rows if row[c] is not None]
            return round(sum(values) / len(values), 3) if values else None

        summary[kind] = {"items": len(rows), "slot_wait_us": mean(0), "products_and_flush_us": mean(1),
                         "handoff_us": mean(2), "to_next_item_us": mean(3),
                         "span_us": round(float(torch.tensor([float(e - b) for b, e in spans.values()]).median()), 2)}
    return summary


def isolated_launch(step: Step, h: torch.Tensor, h_in: torch.Tensor, chained: bool = False) -> dict:
    """Where an isolated launch's time goes (the global timer, in one CUDA graph: a stamp kernel, h's copy, the
    launch with its trace, a stamp kernel; chained: a launch before it, back to back): from the first stamp to the
    first CTA's loader starting layer 0, from there to the last CTA's last down item of the last layer, and from
    that to the second stamp; and the trace's summary (trace_summary)."""
    stamps = torch.zeros(2, dtype=torch.int64, device="cuda")
    step.reset()

    def launches(_):
        _now[(1,)](stamps, 0)
        h_in.copy_(h)
        if chained:
            step.launch(h_in, trace=True)
        step.launch(h_in, trace=True)
        _now[(1,)](stamps, 1)

    chained_us(launches, [0])
    trace = step.trace[:, :step.layers]
    first = int(trace[:, 0, 11][trace[:, 0, 11] > 0].min())
    last = int(trace[:, -1, 7].max())
    a, b = (int(t) for t in stamps)
    sms = step.trace[:, step.layers:].reshape(step.programs, -1)[:, -1].tolist()         # each CTA's SM
    return {"start_us": round((first - a) / 1e3, 2), "layers_us": round((last - first) / 1e3, 2),
            "end_us": round((b - last) / 1e3, 2), "total_us": round((b - a) / 1e3, 2),
            "sm_clock_GHz": item_summary(step.trace, step.layers, step.config["W"])["sm_clock_GHz"],
            "sm_of_cta": sms, "trace": trace_summary(trace)}


def main(argv=None) -> int:
    from int4_mlp_block_probe import engine_chain as mlp_engine_chain
    from int4_mlp_block_probe import measured_configs
    from int4_mma_attention_block_probe import HELD_QKV
    from int4_mma_attention_block_probe import engine_chain as attention_engine_chain

    from tierllm.bench.probe import hbm_copy_GBps

    parser = probe_parser(__doc__, "int4-mma-step-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="STAGES:W:S:AW, comma-separated")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--context", type=int, default=CONTEXT,
                        help="tokens in the sequence with the new one (shorter: fewer KV blocks in shared memory, "
                             "room for more ring slots)")
    parser.add_argument("--trace", action="store_true", help="also record where each config's last launch's time goes")
    parser.add_argument("--isolated", action="store_true",
                        help="also time launches each after a plain kernel, as the engine's decode graph runs them "
                             "(no launch overlaps the one before)")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = step_weights(args.layers, gen)
    state = stacked_state(args.layers, gen, args.context)
    h = torch.randn(HIDDEN, device="cuda", generator=gen)
    h_bf16 = h.bfloat16()
    act = torch.randn(1, INTERMEDIATE, device="cuda", generator=gen).bfloat16()
    ys = [torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]

    def engine_layer(layer: int) -> None:
        attention_engine_chain(weights["attention"][layer], state["layers"][layer], state, h_bf16,
                               weights["attn_norm"][layer], HELD_QKV[0], ys[layer])
        mlp_engine_chain(weights["gate_up"][layer], weights["down"][layer], h_bf16.view(1, -1), act, "held")

    layer_bytes = (sum(t.nbytes for t in weights["attention"][0].values())
                   + sum(weights[name][0][key].nbytes for name in ("gate_up", "down")
                         for key in ("qweight", "scales", "mins"))
                   + 2 * (args.context - 1) * HEADS * HEAD_DIM * 2)
    result = {"layers": args.layers, "floor_us_per_layer": round(layer_bytes / (copy_GBps * 1e9) * 1e6, 2),
              "engine_us_per_layer": round(chained_us(engine_layer, list(range(args.layers))), 2)}
    print(result, flush=True)

    def measure(spec: str, entry: dict) -> None:
        step = Step(weights, state, parse_config(spec))
        step.reset()
        for launch in ("first_launch", "second_launch"):   # the second checks the epochs and the parity
            step.launch(h)
            torch.cuda.synchronize()
            entry[f"rel_err_{launch}"] = layer_errors(step, weights, h)
        entry["gave_up_waits"], entry["counts_as_expected"] = int(step.sync[1].item()), step.counts_as_expected()
        if not step_checks([entry])[0]["passed"]:
            return
        step.reset()
        entry["us_per_step"] = round(chained_us(lambda _: step.launch(h), list(range(4))), 2)
        entry["us"] = round(entry["us_per_step"] / args.layers, 2)
        entry["over_engine"] = round(entry["us"] / result["engine_us_per_layer"], 3)
        entry["over_floor"] = round(entry["us"] / result["floor_us_per_layer"], 3)
        # the timing's chained launches (~90 since the reset, back to back): the last one's layers checked again
        entry["rel_err_after_timing"] = layer_errors(step, weights, h)
        entry["gave_up_waits_after_timing"] = int(step.sync[1].item())
        entry["counts_as_expected_after_timing"] = step.counts_as_expected()
        if args.isolated:        # as in the engine's graph: a plain kernel (h's copy) before each launch
            h_in = h.clone()
            step.reset()
            isolated = chained_us(lambda _: (h_in.copy_(h), step.launch(h_in)), list(range(4)))
            entry["us_isolated"] = round(isolated / args.layers, 2)
            entry["gave_up_waits_isolated"] = int(step.sync[1].item())
            entry["isolated_launch_us"] = isolated_launch(step, h, h_in)
            entry["second_of_two_chained_launches_us"] = isolated_launch(step, h, h_in, chained=True)
        if args.trace:
            step.reset()
            chained_us(lambda _: step.launch(h, trace=True), list(range(2)))
            entry["trace"] = trace_summary(step.trace[:, :step.layers])
            entry["item_trace"] = item_summary(step.trace, step.layers, step.config["W"])

    entries = measured_configs(args.configs.split(","), measure, result, "over_engine")
    write_result(args.out, "int4-mma-step-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "note": "floor_us_per_layer: a layer's int4 weights (qkv, o, gate/up, down: codes, scales, mins) "
                          f"and its {args.context - 1}-token KV cache at the copy rate"},
                 {"note": "the engine's chain of the same layers in the same run: qkv's preparing kernel and HELD "
                          f"(norm, rotary epilogue, cache write) at {HELD_QKV[0]}, paged decode attention, XHALF's o; "
                          "HELD's gate/up and XHALF's down, each after its preparing kernel; all with PDL"},
                 result, step_checks(entries),
                 {"layers": args.layers, "group": GROUP, "ks": KS, "context": args.context, "pdl": True, "eps": EPS})
    print(f"wrote {args.out}")
    return 0


def step_checks(entries: list) -> list:
    """Per checked config: both check launches' layers within 1e-2 of the fp32 reference, no wait gave up, counts
    as expected; per timed config the same of the last launch after the timing's chained launches."""
    checks = []
    for e in entries:
        for keys, when in ((("rel_err_first_launch", "rel_err_second_launch"), "both check launches"),
                           (("rel_err_after_timing",), "the last launch after the timing's chained launches")):
            if keys[-1] in e:
                worst = max(max(e[key].values()) for key in keys)
                suffix = "_after_timing" if "after" in keys[0] else ""
                checks.append({"name": f"{e['config']}: every layer's deltas and cached k and v within 1e-2 of the "
                                       f"fp32 reference on {when}, no wait gave up, counts as expected",
                               "value": worst, "op": "<=", "target": 1e-2,
                               "passed": worst <= 1e-2 and e[f"gave_up_waits{suffix}"] == 0
                               and e[f"counts_as_expected{suffix}"]})
    return checks


if __name__ == "__main__":
    raise SystemExit(main())
