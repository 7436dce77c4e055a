"""Compiling a tuning key's configs in worker processes (tierllm/kernels/parallel_compile.py): a worker compiles a
kernel specialization into Triton's on-disk cache, where the same compile in this process then finds it; a job it
cannot compile is answered with the error and the worker goes on. Offline, for an sm90 target: no GPU needed. The
recording of a launch's specializations needs a GPU (tests/gpu/test_parallel_compile_gpu.py)."""
import os
import subprocess
import sys

import pytest
import torch

from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}


@pytest.fixture(scope="module")
def source_hash() -> str:
    """The compiled (not interpreted: the suite runs under TRITON_INTERPRET=1) kernel's source hash."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = "from tierllm.kernels import residual_add; print(residual_add._add_rounded_kernel.cache_key)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _job(source_hash: str, block: int, **changes):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from tierllm.kernels.parallel_compile import CompileJob

    options = make_backend(GPUTarget(**TARGET)).parse_options({"num_warps": 4}).__dict__
    fields = dict(module="tierllm.kernels.residual_add", qualname="_add_rounded_kernel", cache_key=source_hash,
                  signature={"res_ptr": "*bf16", "sum_ptr": "*bf16", "b_ptr": "*bf16", "n_cols": "i32",
                             "HAS_BIAS": "constexpr", "BLOCK": "constexpr"},
                  constants={(4,): False, (5,): block}, attrs={}, options=options, target=TARGET)
    return CompileJob(**{**fields, **changes})


def _cubins(folder) -> set:
    return {path.relative_to(folder) for path in folder.rglob("*.cubin")}


def test_workers_fill_the_cache_and_answer_what_they_cannot_compile(monkeypatch, tmp_path, source_hash):
    from tierllm.kernels.parallel_compile import WorkerPool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pool = WorkerPool(2)
    jobs = [_job(source_hash, 256), _job(source_hash, 512), _job(source_hash, 256, cache_key="another source")]
    errors = pool.compile(jobs)
    assert errors[:2] == [None, None]
    assert "LookupError" in errors[2]                       # answered, and the other jobs still compiled
    made = _cubins(tmp_path)
    assert len(made) == 2
    assert pool.compile(jobs[:2]) == [None, None]           # the same jobs again: found in the cache
    assert _cubins(tmp_path) == made
    pool.stop()
    assert pool.idle.empty()


def test_worker_count_from_the_environment(monkeypatch):
    from tierllm.kernels import parallel_compile

    monkeypatch.setenv("TIERLLM_COMPILE_WORKERS", "3")
    assert parallel_compile.worker_count() == 3
    monkeypatch.setenv("TIERLLM_COMPILE_WORKERS", "many")
    assert parallel_compile.worker_count() == 0
    monkeypatch.delenv("TIERLLM_COMPILE_WORKERS")
    assert 1 <= parallel_compile.worker_count() <= parallel_compile.MAX_WORKERS
    monkeypatch.setattr(parallel_compile, "usable_cpus", lambda: 16)
    assert parallel_compile.worker_count() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")                 # four tensor-parallel ranks share the CPUs
    assert parallel_compile.worker_count() == 4


def test_usable_cpus_follow_the_cgroup_quota(tmp_path):
    from tierllm.kernels.parallel_compile import usable_cpus

    cpu_max = tmp_path / "cpu.max"
    unlimited = usable_cpus(tmp_path / "absent")
    cpu_max.write_text("max 100000\n")
    assert usable_cpus(cpu_max) == unlimited
    cpu_max.write_text("150000 100000\n")                   # 1.5 CPUs: one worker's worth
    assert usable_cpus(cpu_max) == 1
    cpu_max.write_text(f"{(unlimited + 4) * 100000} 100000\n")  # a quota above the affinity: the affinity
    assert usable_cpus(cpu_max) == unlimited


def test_nothing_is_recorded_for_cpu_weights_or_without_workers(monkeypatch):
    from tierllm.kernels.parallel_compile import precompile

    launched = []
    monkeypatch.setenv("TIERLLM_COMPILE_WORKERS", "4")
    assert precompile([1, 2], lambda config, w: launched.append(config), torch.zeros(2)) == 0
    monkeypatch.setenv("TIERLLM_COMPILE_WORKERS", "0")
    assert precompile([1, 2], lambda config, w: launched.append(config), torch.zeros(2)) == 0
    assert launched == []


def test_workers_that_cannot_start_leave_the_compiling_to_the_timing(monkeypatch, caplog):
    """No compile worker can start (an OSError from Popen): precompile warns and compiles nothing, and tuning goes on
    (its timing compiles in process). The recording itself needs a GPU; here it is a stand-in that records one job."""
    import contextlib
    import logging
    import types

    from tierllm.kernels import parallel_compile

    @contextlib.contextmanager
    def one_job(jobs):
        jobs.append("a job")
        yield jobs

    def no_process(*args, **kwargs):
        raise OSError("no processes left")

    monkeypatch.setenv("TIERLLM_COMPILE_WORKERS", "2")
    monkeypatch.setattr(parallel_compile, "recording", one_job)
    monkeypatch.setattr(parallel_compile, "_pool", lambda size: parallel_compile.WorkerPool(size))
    monkeypatch.setattr(parallel_compile.subprocess, "Popen", no_process)
    parallel_compile._warn_once.cache_clear()
    weight = types.SimpleNamespace(device=torch.device("cuda"))                  # all precompile reads of it
    launched = []
    with caplog.at_level(logging.WARNING, logger="tierllm.kernels.parallel_compile"):
        assert parallel_compile.precompile([1, 2], lambda config, w: launched.append(config), weight) == 0
    assert launched == [1, 2]
    assert "no compile worker (no processes left)" in caplog.text


def _interpreted_tuner():
    """A Triton autotuner of a two-config kernel, under precompiling; None where Triton does not interpret (the
    suite runs with TRITON_INTERPRET=1, set before Triton's import)."""
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import is_interpreted
    from tierllm.kernels.parallel_compile import precompiling

    if not is_interpreted():
        return None

    @triton.jit
    def scaled_copy(x_ptr, y_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * SCALE, mask=offs < n)

    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    return precompiling(triton.autotune(configs=configs, key=["n"])(scaled_copy))


def test_an_autotuner_hands_each_new_keys_configs_to_precompile_before_timing(monkeypatch):
    """precompiling (the prefill GEMMs' autotuners): the first timing of a new key gives precompile every config,
    with a launch that runs that config's kernel on the call's arguments (run here, interpreted); a key seen before
    is not timed again, and a new one is."""
    import triton

    from tierllm.kernels import parallel_compile

    tuner = _interpreted_tuner()
    if tuner is None:
        pytest.skip("needs TRITON_INTERPRET=1 (the suite's setting)")
    handed, call = [], {}

    def recorded(configs, launch, tensor):
        handed.append([config.kwargs["BLOCK"] for config in configs])
        for config in configs:                                              # each launch computes the call's y
            call["y"].zero_()
            launch(config, tensor)
            assert torch.equal(call["y"][:call["n"]], 2 * x[:call["n"]])
        return len(configs)

    monkeypatch.setattr(parallel_compile, "precompile", recorded)
    tuner._do_bench = lambda kernel_call, quantiles: [1.0, 1.0, 1.0]        # the timing itself needs a GPU
    x = torch.randn(40)
    for n in (40, 40, 24):
        call.update(y=torch.zeros(40), n=n)
        tuner[lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),)](x, call["y"], n, SCALE=2.0)
        assert torch.equal(call["y"][:n], 2 * x[:n]) and not call["y"][n:].any()
    assert handed == [[16, 32], [16, 32]]                                  # keys 40 and 24, once each


def test_precompiling_refuses_a_tuner_that_restores_its_arguments():
    import triton

    from tierllm.kernels.parallel_compile import precompiling
    from tierllm.kernels.quant_gemv import _w8_gemv_residual_kernel  # restore_value=["y_ptr"]

    assert isinstance(_w8_gemv_residual_kernel, triton.runtime.Autotuner)
    with pytest.raises(ValueError, match="restore_value"):
        precompiling(_w8_gemv_residual_kernel)
