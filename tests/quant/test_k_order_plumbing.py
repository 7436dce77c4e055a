"""The Llama layers' plumbing of x in the int4 wgmma GEMM's k order, on CPU: with the GEMM's question answered yes
and the GEMM stood in for by the reference on x put back in its usual order, the norms, the attention and the
SiLU-and-mul write x in the k order (their reference paths permute exactly), every int4 projection takes it, and
the logits equal those of the usual path bit for bit. (On an H100/H200 the kernels themselves run:
tests/gpu/test_int4_wgmma_gpu.py.)"""
import copy

import torch
from conftest import build_hf_model, random_prompts

import tierllm
from tierllm.bench.perplexity import prefill_logits
from tierllm.kernels import int4_wgmma, quant_gemm, quant_gemv


def test_every_int4_projection_takes_x_in_the_k_order_with_the_same_logits(monkeypatch):
    hf = copy.deepcopy(build_hf_model("llama_wide"))
    engine = tierllm.init_inference(hf, dtype=torch.float32, quant="int4", show_progress=False, max_num_seqs=4)
    prompt = random_prompts([40], seed=7)[0]                     # a 40-token prefill: 40 rows per projection
    usual = prefill_logits(engine.model, prompt)

    ordered_shapes = []

    def wgmma_stand_in(x, qweight, scales, mins, bias=None, x_permuted=False):
        assert x_permuted
        ordered_shapes.append(tuple(qweight.shape))
        return quant_gemv.w4_linear_ref(int4_wgmma.from_k_order_ref(x), qweight, scales, mins, 64, bias)

    def takes_k_order(x, k, bits, group_size):               # the GPU's answer: int4, group 64, 9-64 rows
        return bits == 4 and group_size == 64 and 8 < x.shape[0] <= 64 and k % 256 == 0

    monkeypatch.setattr(quant_gemm, "takes_x_in_k_order", takes_k_order)          # quant_linear's check
    monkeypatch.setattr(tierllm.kernels, "takes_x_in_k_order", takes_k_order)     # QuantLinear's question
    monkeypatch.setattr(quant_gemm, "w4_wgmma_linear", wgmma_stand_in)
    ordered = prefill_logits(engine.model, prompt)
    assert torch.equal(ordered, usual)
    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    per_layer = [(qkv_rows, config.hidden_size // 2), (config.hidden_size, config.hidden_size // 2),
                 (2 * config.intermediate_size, config.hidden_size // 2),
                 (config.hidden_size, config.intermediate_size // 2)]
    assert ordered_shapes == per_layer * config.num_hidden_layers     # qkv, o, gate/up, down in every layer
