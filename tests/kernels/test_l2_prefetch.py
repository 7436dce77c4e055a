"""kernels/l2_prefetch.py off a GPU: nothing to prefetch into, so every call is a no-op that leaves the work it
wraps alone (the kernel itself runs in tests/gpu/test_gpu_engine.py)."""
import torch

from tierllm.kernels.l2_prefetch import can_prefetch, l2_prefetch, prefetch_bytes_setting, prefetching_during


def test_prefetch_is_a_no_op_on_cpu():
    weight = torch.randn(64, 32)
    before = weight.clone()
    assert not can_prefetch(weight)
    l2_prefetch(weight, 2**20)
    with prefetching_during(weight, 2**20):
        y = weight.sum()
    assert torch.equal(weight, before) and torch.equal(y, before.sum())


def test_prefetch_setting_in_mebibytes(monkeypatch):
    monkeypatch.delenv("TIERLLM_L2_PREFETCH_MB", raising=False)
    assert prefetch_bytes_setting() == 0
    monkeypatch.setenv("TIERLLM_L2_PREFETCH_MB", "1.5")
    assert prefetch_bytes_setting() == 3 * 2**19
