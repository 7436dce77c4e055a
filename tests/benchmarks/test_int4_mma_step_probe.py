"""The decode-step probe's host side (benchmarks/int4_mma_step_probe.py), on CPU: its configs, the work buffer's
regions and the counters' places, the trace summary (a stamp an earlier launch left is not this launch's), and its
checks. The kernel runs on a GPU in the probe, which checks every layer's deltas and cached k and v against the fp32
reference before and after its timing."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_configs_parse():
    from int4_mma_step_probe import parse_config

    assert parse_config("2:4:4:4") == {"STAGES": 2, "W": 4, "S": 4, "AW": 4}
    assert parse_config("3:8:8:4") == {"STAGES": 3, "W": 8, "S": 8, "AW": 4}
    for bad in ("2:4:4", "2:16:4:4", "2:2:4:4", "2:4:4:4l", "2:4:4:4m"):  # three numbers; 16 or 2 consumer
        with pytest.raises(ValueError):                                    # warps; a flag (none is left)
            parse_config(bad)


def test_the_two_ctas_of_a_tpc_take_one_of_the_first_work_ids_and_one_of_the_last():
    from tierllm.kernels.int4_step import work_id

    programs = 132
    ids = [work_id(pid, programs) for pid in range(programs)]
    assert sorted(ids) == list(range(programs))
    assert all(ids[2 * k] == k and ids[2 * k + 1] == k + programs // 2 for k in range(programs // 2))


def test_work_regions_and_counters_do_not_overlap():
    import tierllm.kernels.int4_step as p
    from tierllm.kernels.int4_tiles import GROUP

    regions = [(p.QKV_AT, 3 * p.HEADS * p.HEAD_DIM), (p.Y_AT, p.HIDDEN), (p.GU_AT, 2 * p.INTERMEDIATE),
               (p.Z_AT, p.HIDDEN)]
    ends = [at + width for at, width in regions]
    assert [at for at, _ in regions[1:]] == ends[:-1] and ends[-1] == p.WIDTH
    places = ([range(0, p.HEADS), range(p.SPLITS_AT, p.SPLITS_AT + p.HEADS),
               range(p.MERGED_AT, p.MERGED_AT + p.O_SLICES), [p.O_DONE_AT],
               range(p.CHUNKS_AT, p.CHUNKS_AT + p.DN_SLICES), [p.DN_DONE_AT]])
    flat = [i for place in places for i in place]
    assert flat == list(range(p.COUNTERS))
    assert p.DN_SLICES * p.KS * GROUP >= p.INTERMEDIATE > (p.DN_SLICES - 1) * p.KS * GROUP


def test_trace_summary_starts_at_the_loaders_first_stamp_and_skips_stale_stamps():
    from int4_mma_step_probe import TRACE_POINTS, trace_summary

    programs, layers = 4, 3
    trace = torch.zeros(programs, layers, len(TRACE_POINTS), dtype=torch.int64)
    start = 1_000_000
    for layer in range(layers):
        trace[:, layer, 11] = start + layer * 40_000 + torch.arange(programs) * 1_000    # loader: layer started
        trace[:, layer, 0] = start + layer * 40_000 + 5_000 + torch.arange(programs) * 1_000
    trace[0, 1, 15] = start - 500_000          # a merge stamp an earlier launch left
    trace[2, 1, 15] = start + 50_000
    summary = trace_summary(trace)
    started = summary["loader: layer started"]
    assert started["layers_0_1_mid_last_us"] == [1.0, 41.0, 41.0, 81.0]        # torch's lower median of 0-3 us
    assert started["mid_latest_us"] == 43.0 and started["median_period_us"] == 40.0
    assert summary["loader: qkv's x ready"]["layers_0_1_mid_last_us"][0] == 6.0
    assert summary["attention: a head merged"]["layers_0_1_mid_last_us"][1] == 50.0


def test_checks_fail_a_config_whose_launch_after_the_timing_is_off():
    from int4_mma_step_probe import step_checks

    good = {"attention": 3e-3, "mlp": 2e-3, "k_cached": 3e-3, "v_cached": 2e-3}
    entry = {"config": "2:4:4:4", "rel_err_first_launch": good, "rel_err_second_launch": good, "gave_up_waits": 0,
             "counts_as_expected": True, "rel_err_after_timing": dict(good, mlp=0.5),
             "gave_up_waits_after_timing": 0, "counts_as_expected_after_timing": True}
    checks = step_checks([entry])
    assert [c["passed"] for c in checks] == [True, False]
    entry["rel_err_after_timing"] = good
    entry["counts_as_expected_after_timing"] = False
    assert [c["passed"] for c in step_checks([entry])] == [True, False]


def test_item_kinds_cover_every_item_of_a_layer_once():
    import int4_mma_step_probe as p

    programs, tiles = 132, 4
    counts = {}
    for pid in range(programs):
        kinds = p.item_kinds(pid, programs, tiles)
        assert kinds == sorted(kinds, key=["qkv", "o", "gate/up", "down"].index)     # in the consumers' order
        for kind in kinds:
            counts[kind] = counts.get(kind, 0) + 1
    per_kind = {"qkv": p.HEADS * p.HEAD_TILES // tiles * p.QKV_SLICES, "o": p.HIDDEN // 16 // tiles * p.O_SLICES,
                "gate/up": 2 * p.INTERMEDIATE // 16 // tiles * p.GU_SLICES,
                "down": p.HIDDEN // 16 // tiles * p.DN_SLICES}
    assert counts == per_kind


def test_item_summary_reads_clock_stamps_at_each_ctas_clock_rate():
    import int4_mma_step_probe as p

    programs, layers = 132, 3
    trace = torch.zeros(programs, layers + p.ITEM_ROWS, len(p.TRACE_POINTS), dtype=torch.int64)
    flat = trace[:, layers:].reshape(programs, -1)
    # item i at 1000 + 2000 i cycles: slot wait 100, products 1400, handoff 200, then 300 to the next item's wait
    item = torch.arange(p.ITEM_ITEMS)[:, None] * 2000 + 1000 + torch.tensor([0, 100, 1500, 1700])
    flat[:, :p.ITEM_ITEMS * 4] = item.reshape(-1)
    flat[:, p.ITEM_ITEMS * 4:p.ITEM_ITEMS * 4 + 4] = torch.tensor([0, 0, 2_000_000, 1_000_000])      # 2 GHz
    trace[:, layers:] = flat.view(programs, p.ITEM_ROWS, -1)
    summary = p.item_summary(trace, layers, 4)
    assert summary["sm_clock_GHz"] == 2.0
    qkv = summary["qkv"]
    assert (qkv["slot_wait_us"], qkv["products_and_flush_us"], qkv["handoff_us"], qkv["to_next_item_us"]) == \
        (0.05, 0.7, 0.1, 0.15)
    assert qkv["items"] == sum(p.item_kinds(pid, programs, 4).count("qkv") for pid in range(programs))
