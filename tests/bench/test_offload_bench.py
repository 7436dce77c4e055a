"""The offload bench's step timer (CUDA events stand in for a fake clock here: the bench itself needs a GPU)."""
import torch

from tierllm.bench import offload_bench


class FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = FakeEvent.clock[0]

    def elapsed_time(self, end):                 # milliseconds, as torch.cuda.Event
        return end.at - self.at


class FakeRunner:
    def __init__(self, step_ms):
        self.step_ms = list(step_ms)

    def forward_plan(self, plan):
        FakeEvent.clock[0] += self.step_ms.pop(0)
        return plan


def test_step_timer_reports_device_time_per_step_and_restores_the_runner(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runner = FakeRunner([30.0, 10.0, 20.0])
    original = runner.forward_plan
    with offload_bench.StepTimer(runner) as timer:
        assert [runner.forward_plan(i) for i in range(3)] == [0, 1, 2]
    assert runner.forward_plan == original
    summary = timer.summary(total_s=5.0)
    assert summary["steps"] == 3 and summary["step_device_ms_median"] == 20.0
    assert summary["step_device_ms_max"] == 30.0 and summary["steps_device_s"] == 0.06
    assert 4.9 < summary["host_outside_forward_s"] <= 5.0       # the fake forward passes took no host time
    assert summary["step_device_ms"] == [30.0, 10.0, 20.0]        # in step order


def test_quantized_offload_check_takes_the_batch_closest_to_its_floor_and_records_the_fastest():
    result = {"runs": [{"batch": 4, "total_tok_s": 7.8, "fraction_of_floor_throughput": 0.868},
                       {"batch": 8, "total_tok_s": 14.9, "fraction_of_floor_throughput": 0.829},
                       {"batch": 32, "total_tok_s": 48.2, "fraction_of_floor_throughput": 0.670}]}
    passed = offload_bench.best_batch_check(result, "llama-70b int4 offloaded")
    assert passed["passed"] and passed["value"] == 0.868 and "best batch (4)" in passed["name"]
    assert result["best_batch"] == 4 and result["most_tok_s_batch"] == 32
    result["runs"][0]["fraction_of_floor_throughput"] = 0.80
    assert not offload_bench.best_batch_check(result, "x")["passed"]                 # 0.829 at batch 8 < 0.85


def test_busy_time_is_the_union_of_intervals():
    from tierllm.bench.copy_overlap import busy_us
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 12), (20, 25)]) == 17           # overlap counted once, gap not at all
    assert busy_us([(20, 25), (0, 10), (2, 3)]) == 15            # unsorted, nested


def test_copy_overlap_profile_on_cpu_has_no_device_time():
    from tierllm.bench.copy_overlap import profile_copy_overlap
    out = profile_copy_overlap(lambda: torch.randn(64, 64) @ torch.randn(64, 64))
    assert out["wall_s"] > 0
    assert out["htod_copy_busy_s"] == out["kernel_busy_s"] == out["copy_under_kernels_s"] == 0
