"""The graph tuner's timings kept on disk (tierllm/kernels/tuning_cache.py): a later process takes its picks without
timing, a changed config list or an unreadable file times afresh, TIERLLM_TUNING_CACHE=0 keeps nothing. The
launches here are made up (no kernel runs): what is tested is which configs get timed and which one is taken."""
import json
import sys
from pathlib import Path

import pytest
import torch

from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

MS = {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5}                 # BLOCK -> made-up ms per launch


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """(tune(configs) -> the pick, the configs timed so far, the cache file); each tune() starts as a new process
    would: an empty in-memory cache. BLOCK=3 is refused by the compiler."""
    import triton
    from triton.runtime.errors import OutOfResources

    from tierllm.kernels import graph_tuning

    path = tmp_path / "tuning.json"
    monkeypatch.setenv("TIERLLM_TUNING_CACHE", str(path))
    monkeypatch.setattr(graph_tuning, "TUNED_SITES", [])
    monkeypatch.setattr(graph_tuning, "weight_copies", lambda weight: [weight])
    timed = []

    def launch(config, weight):
        if config.kwargs["BLOCK"] == 3:
            raise OutOfResources(300000, 232448, "shared memory")
        timed.append(config)

    def fake_seconds(run, copies):
        run(copies[0])
        return MS[timed[-1].kwargs["BLOCK"]] / 1e3

    monkeypatch.setattr(graph_tuning, "graph_seconds", fake_seconds)

    def tune(blocks):
        configs = [triton.Config({"BLOCK": b}, num_warps=4) for b in blocks]
        return graph_tuning.tune_site({}, (7, "key"), configs, launch, torch.zeros(4, 4), 1)
    return tune, timed, path


def test_a_later_process_takes_the_cached_pick_without_timing(tuning):
    from tierllm.kernels import graph_tuning
    tune, timed, path = tuning
    assert tune([1, 2, 3]).kwargs["BLOCK"] == 2
    assert [c.kwargs["BLOCK"] for c in timed] == [1, 2] and path.exists()
    assert tune([1, 2, 3]).kwargs["BLOCK"] == 2
    assert len(timed) == 2                                          # nothing timed the second time
    first, second = graph_tuning.TUNED_SITES                        # both kept for step tuning, same timings
    assert {c.kwargs["BLOCK"]: t for c, t in second.timings.items()} == {1: 3.0, 2: 1.0}
    assert [str(c) for c in first.timings] == [str(c) for c in second.timings]


def test_a_changed_config_list_times_again(tuning):
    tune, timed, _ = tuning
    tune([1, 2, 3])
    assert tune([1, 2, 3, 4]).kwargs["BLOCK"] == 4
    assert [c.kwargs["BLOCK"] for c in timed] == [1, 2, 1, 2, 4]


def test_an_unreadable_cache_times_afresh_and_is_rewritten(tuning):
    from tierllm.kernels import tuning_cache
    tune, timed, path = tuning
    path.write_text("{not json")
    assert tune([1, 2]).kwargs["BLOCK"] == 2 and len(timed) == 2
    kept = json.loads(path.read_text())
    assert len(kept) == 2 and len(kept[tuning_cache.VERSIONS_KEY]) == 1           # one entry and its code version


def test_tuning_cache_off(tuning, monkeypatch):
    tune, timed, path = tuning
    monkeypatch.setenv("TIERLLM_TUNING_CACHE", "0")
    tune([1, 2])
    tune([1, 2])
    assert len(timed) == 4 and not path.exists()


def test_an_unwritable_cache_is_passed_over(tuning, monkeypatch, tmp_path):
    tune, timed, _ = tuning
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TIERLLM_TUNING_CACHE", str(blocker / "tuning.json"))    # its folder is a file
    assert tune([1, 2]).kwargs["BLOCK"] == 2 and len(timed) == 2


def test_the_code_hash_covers_the_tuned_kernels_and_what_they_import_only():
    """Cached picks go stale with any change to a tuned GEMV or a kernel module it builds on (PDL, the split-K
    counters, the norm, the rotary embedding that int4's QKV site is timed with), and not with changes to kernels
    the tuner never times or to the tuning machinery (how configs are timed, compiled and kept)."""
    from tierllm.kernels import tuning_cache

    names = {path.name for path in tuning_cache.tuned_sources()}
    assert {"gemv.py", "quant_gemv.py", "w4_mma_gemv.py", "gemv_all_reduce.py", "_dispatch.py", "split_k.py",
            "int4_held_x.py", "rotary.py"} <= names
    assert not names & {"decode_attention.py", "prefill_attention.py", "graph_tuning.py", "tuning_cache.py",
                        "parallel_compile.py", "compile_worker.py"}


def test_first_timing_says_so_once_and_each_timed_key_is_logged(tuning, caplog):
    """A first use times configs for minutes with nothing on screen: the first timing in a process warns once (where
    the timings are kept), each timed key logs its config count and time, and a cached key warns nothing."""
    import logging

    from tierllm.kernels import graph_tuning
    tune, _, path = tuning
    graph_tuning._first_timing_notice.cache_clear()
    with caplog.at_level(logging.INFO, logger="tierllm.kernels.graph_tuning"):
        tune([1, 2])
        tune([1, 2, 4])
        tune([1, 2])                                                 # from the cache
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "launch configs" in warnings[0] and str(path) in warnings[0]
    timed = [r.getMessage() for r in caplog.records if "configs timed in" in r.getMessage()]
    assert len(timed) == 2 and "2 configs" in timed[0] and "3 configs" in timed[1]
    assert sum("from the tuning cache" in r.getMessage() for r in caplog.records) == 1


def test_the_file_says_which_sources_it_was_timed_for(tuning, capsys):
    """Before a GPU run that should take kept picks: the file records the tuned sources (and GPU, compilers) it holds
    timings for, and benchmarks/tuning_file_status.py says whether this checkout's sources are among them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from tuning_file_status import main

    from tierllm.kernels import tuning_cache
    tune, _, path = tuning
    main([str(path)])
    assert "none for these sources" in capsys.readouterr().out                  # no file yet
    tune([1, 2])
    [version] = tuning_cache.kept_versions(path)
    assert version["sources"] == tuning_cache.sources_hash() and version["gpu"] == "cpu"
    main([str(path)])
    out = capsys.readouterr().out
    assert "timings kept for these sources on cpu" in out and "none for these" not in out
    kept = json.loads(path.read_text())
    versions = kept.pop(tuning_cache.VERSIONS_KEY)
    path.write_text(json.dumps(kept))                                           # a file from before the record
    main([str(path)])
    assert "cannot tell" in capsys.readouterr().out
    tune([1, 2])                                                                # a hit records the version
    assert tuning_cache.kept_versions(path) == [version]
    kept[tuning_cache.VERSIONS_KEY] = {key: {**v, "sources": "0" * 16} for key, v in versions.items()}
    path.write_text(json.dumps(kept))                                           # timed for other sources
    main([str(path)])
    assert "none for these sources" in capsys.readouterr().out
