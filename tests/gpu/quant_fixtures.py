"""Fixtures shared by the GPU tests of quantized models."""
import pytest

from tierllm.kernels import int8_gemm, quant_gemm, quant_gemv


@pytest.fixture
def first_config_only(monkeypatch):
    """Every autotuned kernel keeps its first config: the tiny model's launch shapes (each CUDA-graph batch size,
    each fusion) would otherwise compile and time every config of every kernel, minutes on the GPU machine; the
    kernel tests run each config on its own. The graph tuner likewise times only the first config it is offered
    (an int4 tiny model took over 5 minutes without), with no tuning file and no decode-step tuning."""
    keep_first_configs(monkeypatch)


def keep_first_configs(monkeypatch) -> None:
    """first_config_only's patches, on any MonkeyPatch (a module's fixture holds one for its engine's life)."""
    from triton.runtime.autotuner import Autotuner

    from tierllm.kernels import gemv, graph_tuning
    for module in (gemv, quant_gemv, quant_gemm, int8_gemm):
        for tuner in [obj for obj in vars(module).values() if isinstance(obj, Autotuner)]:
            monkeypatch.setattr(tuner, "configs", tuner.configs[:1])
    pick = graph_tuning.GraphTuner.pick
    monkeypatch.setattr(graph_tuning.GraphTuner, "pick", lambda self, key, launch, weight, block_m, configs=None:
                        pick(self, key, launch, weight, block_m, (configs or self.configs)[:1]))
    monkeypatch.setenv("TIERLLM_TUNING_CACHE", "0")
    monkeypatch.setenv("TIERLLM_STEP_TUNER", "0")
