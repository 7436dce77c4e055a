"""Quantized presets generated layer by layer load like a `tierllm quantize` folder."""
import torch

from tierllm.api import InferenceEngine, build_engine
from tierllm.bench.quant_presets import preset_quant_checkpoint
from tierllm.layers.quant_linear import QuantLinear
from tierllm.layers.quant_lm_head import QuantLMHead


def test_quantized_preset_loads_and_generates():
    """int4 layers with an int8 LM head (the preset's head is tied: it gets its own int8 rows)."""
    ckpt = preset_quant_checkpoint("smollm2-135m", {"bits": 4, "lm_head": True}, dtype=torch.float32, device="cpu")
    engine = InferenceEngine(*build_engine(ckpt, dtype=torch.float32, device="cpu", show_progress=False,
                                           num_kv_blocks=16, max_model_len=64))
    head = engine.model.lm_head
    assert isinstance(head, QuantLMHead) and head.qweight.dtype == torch.int8 and head.qweight.shape == (49152, 576)
    qlinears = [m for m in engine.model.decoder_layers().modules() if isinstance(m, QuantLinear)]
    assert len(qlinears) == 30 * 4 and all(m.qweight.dtype == torch.uint8 for m in qlinears)
    assert engine.model.model.norm.weight.eq(1).all()
    out = engine.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
