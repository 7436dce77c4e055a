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


def test_candidate_window_and_cap_follow_the_environment(monkeypatch):
    site = make_site("s", {f"c{i}": 1.0 + 0.05 * i for i in range(20)})
    assert step_tuning.candidates(site) == ["c0", "c1", "c2"]                          # within 10%
    monkeypatch.setenv("TIERLLM_STEP_CLOSE", "1.3")
    monkeypatch.setenv("TIERLLM_STEP_CANDIDATES", "5")
    assert step_tuning.candidates(site) == [f"c{i}" for i in range(5)]


class _Config:
    """A stand-in for triton.Config: its kwargs (the int4 tuner marks tensor-core configs with TENSOR_CORES)."""

    def __init__(self, name: str, **kwargs):
        self.name, self.kwargs = name, kwargs

    def __repr__(self) -> str:
        return self.name


def test_candidates_add_the_other_kernels_fastest():
    """However slow alone, the OTHER_KERNEL fastest configs of the other kernel a site chooses between are tried in
    the step."""
    mma = [_Config(f"mma{i}", TENSOR_CORES=True) for i in range(3)]
    loops = [_Config(f"loop{i}", BLOCK_N=4) for i in range(step_tuning.OTHER_KERNEL + 2)]
    timings = {mma[0]: 1.0, mma[1]: 1.02, mma[2]: 1.5} | {loop: 1.2 + 0.1 * i for i, loop in enumerate(loops)}
    assert step_tuning.candidates(make_site("s", timings)) == mma[:2] + loops[:step_tuning.OTHER_KERNEL]
    timings = {loops[0]: 1.0, mma[0]: 1.01, mma[1]: 1.3}             # one of them close already: it counts
    assert step_tuning.candidates(make_site("t", timings)) == [loops[0], mma[0], mma[1]]


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


def test_batch1_sites_are_the_batch1_ones_since(monkeypatch):
    sites = [make_site("a", {"x": 1.0, "y": 1.01}), make_site("batch2", {"x": 1.0, "y": 1.01}, block_m=2),
             make_site("alone", {"x": 1.0}), TunedSite({"untimed": "x"}, "untimed", {}, 1)]
    monkeypatch.setattr(graph_tuning, "TUNED_SITES", sites)
    assert step_tuning.batch1_sites() == [sites[0], sites[2], sites[3]]
    assert step_tuning.batch1_sites(since=2) == sites[2:]


def test_refine_skips_sites_without_a_choice():
    sites = [make_site("alone", {"x": 1.0}), TunedSite({"untimed": "x"}, "untimed", {}, 1)]
    step_seconds, calls = step_of(sites, {"alone": {"x": 1.0}, "untimed": {"x": 1.0}})
    assert step_tuning.refine(sites, step_seconds) == [] and len(calls) == 1


def test_refine_in_lockstep_follows_rank0s_plan_and_verdicts():
    """A tensor-parallel rank (share: rank 0's values) tries rank 0's candidates on its own sites, even where its
    own timings alone would rank them otherwise, and keeps what rank 0's step times decide."""
    rank0 = [make_site("s", {"c1": 1.0, "c2": 1.01, "c3": 1.02})]
    rank1 = [make_site("s", {"c3": 0.9, "c2": 1.0, "c1": 1.5})]        # c1 not a candidate of its own
    step0, _ = step_of(rank0, {"s": {"c1": 10.0, "c2": 0.0, "c3": 5.0}})
    report0 = step_tuning.refine(rank0, step0)
    shared = iter([[("s", ["c2", "c3"])], True, False])               # what rank 0 broadcast, in order
    step1, calls1 = step_of(rank1, {"s": {"c1": 0.0, "c2": 9.0, "c3": 9.0}})
    report1 = step_tuning.refine(rank1, step1, share=lambda value: next(shared))
    assert rank0[0].cache["s"] == rank1[0].cache["s"] == "c2"
    assert len(calls1) == 1 + 2 and report0[0]["after"] == report1[0]["after"] == "c2"


def test_refine_in_lockstep_keeps_time_without_rank0s_key():
    """A rank that lacks one of rank 0's keys (tuned there by an earlier engine of the process) still times every
    trial, and changes nothing of its own."""
    mine = make_site("other", {"x": 1.0, "y": 1.01})
    shared = iter([[("s", ["c2", "c3"])], True, True])
    step, calls = step_of([mine], {"other": {"x": 1.0, "y": 1.0}})
    assert step_tuning.refine([mine], step, share=lambda value: next(shared)) == []
    assert len(calls) == 1 + 2 and mine.cache["other"] == "x"


def test_step_tuning_default(monkeypatch):
    """On for one GPU and off at TP > 1 unless TIERLLM_STEP_TUNER says otherwise."""
    monkeypatch.delenv("TIERLLM_STEP_TUNER", raising=False)
    assert step_tuning.step_tuning() and step_tuning.step_tuning(1) and not step_tuning.step_tuning(2)
    monkeypatch.setenv("TIERLLM_STEP_TUNER", "1")
    assert step_tuning.step_tuning(1) and step_tuning.step_tuning(2)
    monkeypatch.setenv("TIERLLM_STEP_TUNER", "0")
    assert not step_tuning.step_tuning(1) and not step_tuning.step_tuning(2)


def test_ranks_adopt_rank0s_picks_by_name():
    """Rank 1 picked its own near-ties; rank 0's choices (by key and config name) replace them, except where rank 1
    lacks the key or the config."""
    rank0 = [make_site("a", {"a1": 1.0, "a2": 1.01}), make_site("b", {"b1": 2.0, "b2": 2.01}),
             make_site("only0", {"x": 1.0, "y": 1.1})]
    rank1 = [make_site("a", {"a1": 1.02, "a2": 1.0}), make_site("b", {"b1": 2.0, "b2": 2.1}),
             make_site("c", {"c1": 1.0, "c2": 1.2}), make_site("only0", {"y": 1.0})]
    picks_of_rank0 = {}

    def share(value):
        picks_of_rank0.setdefault("sent", value)
        return picks_of_rank0["sent"]
    assert step_tuning.adopt_driver_picks(rank0, share) == 0            # rank 0 keeps its own
    changed = step_tuning.adopt_driver_picks(rank1, share)
    assert changed == 1
    assert [site.cache[site.key] for site in rank1] == ["a1", "b1", "c1", "y"]
