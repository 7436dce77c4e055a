"""bench/kernel_timeline.decode_timeline on a made-up kernel list: whole steps only, per-kernel durations, and gaps
(negative where a kernel started before the one before it ended, as under programmatic dependent launch)."""
import pytest

from tierllm.bench.kernel_timeline import STEP_ENDS, decode_timeline

ARGMAX = STEP_ENDS[1] + "<512, 1>"


def _step(t0: float, gemv_gap: float, pick: str = ARGMAX) -> list:
    """One decode step from t0: a norm (2 us), a GEMV starting gemv_gap after it (10 us), the greedy pick (1 us)
    0.5 us after that."""
    gemv_start = t0 + 2 + gemv_gap
    return [(t0, 2.0, "_norm_kernel"), (gemv_start, 10.0, "_gemv_body"), (gemv_start + 10.5, 1.0, pick)]


@pytest.mark.parametrize("pick", [ARGMAX, STEP_ENDS[0]], ids=["torch_argmax", "greedy_kernel"])
def test_steps_between_argmaxes_give_durations_and_gaps(pick):
    kernels = ([(0.0, 1.0, pick)] + _step(5, 1.0, pick) + _step(30, -0.5, pick) + _step(60, -0.5, pick)
               + [(90.0, 3.0, "_norm_kernel")])
    table = decode_timeline(kernels)
    assert table["steps"] == 2                          # the first step (after the prompt) and the tail left out
    by = table["by_kernel"]
    assert by["_gemv_body"] == {"per_step": 1.0, "dur_us": 10.0, "gap_before_us": -0.5}
    assert by["_norm_kernel"]["gap_before_us"] == 0.0   # each step's span starts at its first kernel
    assert by[pick]["gap_before_us"] == 0.5
    assert table["step_span_us_median"] == pytest.approx(2 - 0.5 + 10 + 0.5 + 1)
    assert table["kernel_us_sum_median"] == 13.0


def test_too_few_steps_is_a_clear_error():
    with pytest.raises(ValueError, match="three or more"):
        decode_timeline([(0.0, 1.0, ARGMAX)] + _step(5, 1.0))
