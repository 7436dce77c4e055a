"""The attention-block probe's fused kernel (benchmarks/int4_attention_block_probe.py: QKV with its rotary epilogue,
the split attention, the merge and o in one kernel whose items wait on per-head counters) against the torch
reference of the block, with one program on a small block; on CPU through Triton's interpreter, on a GPU natively."""
import sys
from pathlib import Path

import pytest

from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_fused_attention_block_matches_the_reference():
    from int4_attention_block_probe import CHECK_CONFIGS, check_block

    errors = check_block(CHECK_CONFIGS[0])          # round robin, 4-row QKV blocks, two splits per head
    assert errors["wait_errors"] == 0
    # XHALF's fp16 products and the bf16 roundings of q, k, v and the attention put the block 0.4-0.9% from the
    # fp32 reference here; a merge without its weights gives 20% on o, a wrong rotary pairing 60-120%
    assert max(errors["o"], errors["k_cached"], errors["v_cached"]) < 2e-2, errors
