"""Decode-step tuning's coordinate descent (runner/step_tuning.py) on made-up sites and step times; the GPU path
(capture and replay timing) is tested in tests/gpu/test_gpu_engine.py."""
import pytest

from tierllm.kernels import graph_tuning
from tierllm.kernels.graph_tuning import TunedSite
from tierllm.runner import step_tuning


def make_site(key: str, timings: dict, block_m: int = 1) -> TunedSite:
    """A site as Triton's tuner leaves it: the fastest config alone in its cache."""
    return TunedSite({key: min(timings, key=timings.get)}, key, timings, block_m)


def step_of(sites, costs: dict, base: float = 1000.0):
    """step_seconds() for refine: base plus each site's in-step cost of its current config; counts its calls."""
    calls = []

    def step_seconds() -> float:
        calls.append(1)
        return base + sum(costs[site.key][site.cache[site.key]] for site in sites)
    return step_seconds, calls


def test_candidates_are_the_close_ones_fastest_first_capped():
    site = make_site("s", {f"c{i}": 1.0 + 0.005 * i for i in range(20)} | {"far": 1.2})
    chosen = step_tuning.candidates(site)
    assert chosen == [f"c{i}" for i in range(step_tuning.CANDIDATES)]
    assert step_tuning.candidates(make_site("t", {"only": 1.0})) == ["only"]
    assert step_tuning.candidates(TunedSite({"u": "x"}, "u", {}, 1)) == []


def test_refine_takes_a_close_config_that_shortens_the_step_by_more_than_the_margin():
    a = make_site("a", {"a1": 1.0, "a2": 1.01, "a3": 1.2})          # a3: not close enough alone to be tried
    b = make_site("b", {"b1": 2.0, "b2": 2.05})                     # b2: slower in the step
    c = make_site("c", {"c1": 0.5, "c2": 0.51})                     # c2: faster, within the margin
    costs = {"a": {"a1": 10.0, "a2": 5.0, "a3": 0.0}, "b": {"b1": 3.0, "b2": 3.5},
             "c": {"c1": 2.0, "c2": 2.0 - 0.5 * step_tuning.MARGIN * 1000}}
    step_seconds, calls = step_of([a, b, c], costs)
    report = step_tuning.refine([a, b, c], step_seconds)
    assert (a.cache["a"], b.cache["b"], c.cache["c"]) == ("a2", "b1", "c1")
    assert len(calls) == 1 + 3                                       # the start, then a2, b2, c2
    assert [row["key"] for row in report] == ["b", "a", "c"]         # the longest alone first
    row_a = report[1]
    assert (row_a["before"], row_a["after"]) == ("a1", "a2")
    assert row_a["step_ms_after"] == pytest.approx(row_a["step_ms_before"] - 5e3)
    assert report[2]["step_ms_before"] == row_a["step_ms_after"]      # each site starts from the choices before it


def test_batch1_sites_are_the_batch1_ones_with_a_choice(monkeypatch):
    keep = make_site("keep", {"x": 1.0, "y": 1.01})
    sites = [keep, make_site("batch2", {"x": 1.0, "y": 1.01}, block_m=2), make_site("alone", {"x": 1.0}),
             TunedSite({"untimed": "x"}, "untimed", {}, 1)]
    monkeypatch.setattr(graph_tuning, "TUNED_SITES", sites)
    assert step_tuning.batch1_sites() == [keep]
    assert step_tuning.batch1_sites(since=1) == []


def test_step_tuning_is_opt_in(monkeypatch):
    monkeypatch.delenv("TIERLLM_STEP_TUNER", raising=False)
    assert not step_tuning.step_tuning()
    monkeypatch.setenv("TIERLLM_STEP_TUNER", "1")
    assert step_tuning.step_tuning()
