"""The int4 step kernel's engine glue on the CPU (runner/int4_decode_step.py): which models and steps it takes, the
stacked KV cache it reads, the repacked weights it stacks. Its launches, against the engine's chain, run on a GPU
(tests/gpu/test_int4_step_gpu.py)."""
import pytest
import torch

from tierllm.bench.presets import preset_config
from tierllm.config import QuantConfig
from tierllm.kernels.int4_tiles import repacked
from tierllm.layers.attention import Attention
from tierllm.models.llama import LlamaForCausalLM
from tierllm.quant.quantize import convert_to_quant_shells
from tierllm.runner import int4_decode_step as glue
from tierllm.runner.cuda_graph import CudaGraphDecoder
from tierllm.runner.input_builder import StepPlan
from tierllm.runner.kv_cache import allocate_kv_cache, stacked_kv_cache

INT4 = QuantConfig(bits=4)


def _shell(quant=INT4, layers: int = 2, **overrides) -> LlamaForCausalLM:
    """A llama-7b-shaped model of `layers` layers on the meta device, its linears quantized shells."""
    config = preset_config("llama-7b")
    config.num_hidden_layers = layers
    for name, value in overrides.items():
        setattr(config, name, value)
    model = LlamaForCausalLM(config, 16, torch.bfloat16, torch.device("meta"))
    return convert_to_quant_shells(model, quant) if quant is not None else model


def test_llama_7b_shaped_int4_g64_models_are_taken():
    assert glue.model_reason(_shell(), torch.bfloat16, 16) is None


@pytest.mark.parametrize("model, dtype, block_size, why", [
    (lambda: _shell(), torch.float16, 16, "bfloat16"),
    (lambda: _shell(), torch.bfloat16, 32, "blocks of 16"),
    (lambda: _shell(None), torch.bfloat16, 16, "int4"),
    (lambda: _shell(QuantConfig(bits=8)), torch.bfloat16, 16, "int4"),
    (lambda: _shell(QuantConfig(bits=4, group_size=128)), torch.bfloat16, 16, "groups of 64"),
    (lambda: _shell(QuantConfig(bits=4, symmetric=True)), torch.bfloat16, 16, "asymmetric"),
    (lambda: _shell(num_key_value_heads=8), torch.bfloat16, 16, "without GQA"),
    (lambda: _shell(intermediate_size=14336), torch.bfloat16, 16, "intermediate 11008"),
    (lambda: _shell(attention_bias=True), torch.bfloat16, 16, "without bias"),
], ids=["fp16", "block-32", "dense", "int8", "g128", "symmetric", "gqa", "mlp-width", "bias"])
def test_other_models_keep_the_chain_and_say_why(model, dtype, block_size, why):
    assert why in glue.model_reason(model(), dtype, block_size)


def test_the_step_kernel_needs_hopper():
    assert glue.device_reason(torch.device("cpu")) is not None


def test_attention_chunks_follow_the_context():
    # 16-token blocks in 4 splits, chunks of 4 blocks: up to 256 cached tokens per chunk count
    assert [glue.step_chunks(n) for n in (2, 17, 257, 258, 544, 640, 1025, 1026)] == [1, 1, 1, 2, 3, 3, 4, 5]
    assert glue.chunk_counts(1024) == [1, 2, 3, 4]
    assert glue.chunk_counts(4096) == [1, 2, 3, 4]
    assert glue.chunk_counts(300) == [1, 2]


class _Step:
    failed = False


def _plan(context_lens: list[int]) -> StepPlan:
    n = len(context_lens)
    return StepPlan([1] * n, [c - 1 for c in context_lens], [c - 1 for c in context_lens], n,
                    [[0] * -(-c // 16) for c in context_lens], context_lens, [], [], [], list(range(n)), [], 1)


def test_batch_1_steps_whose_context_fits_replay_a_step_graph():
    step = _Step()
    graphs = CudaGraphDecoder(None, 4, 64, torch.device("cpu"), step, max_model_len=1024)
    assert graphs.key_for(_plan([544])) == (1, 3)
    assert graphs.key_for(_plan([5])) == (1, 1)
    assert graphs.key_for(_plan([1024])) == (1, 4)
    assert graphs.key_for(_plan([544, 20])) == 2                   # batches run the chain
    step.failed = True                                             # a wait gave up: the chain from then on
    assert graphs.key_for(_plan([544])) == 1
    longer = CudaGraphDecoder(None, 1, 128, torch.device("cpu"), _Step(), max_model_len=2048)
    assert longer.key_for(_plan([1500])) == 1                      # past the kernel's shared memory: the chain
    assert CudaGraphDecoder(None, 1, 64, torch.device("cpu")).key_for(_plan([544])) == 1


def _attention(heads: int, head_dim: int) -> Attention:
    return Attention(heads, heads, head_dim, head_dim ** -0.5)


def test_kv_caches_of_one_shape_are_views_of_one_tensor():
    caches = allocate_kv_cache([_attention(2, 8)] * 3, 5, 4, torch.bfloat16, torch.device("cpu"))
    k_stack, v_stack = stacked_kv_cache(caches)
    assert k_stack.shape == v_stack.shape == (3, 5, 4, 2, 8)
    caches[1][0][2, 3] = torch.randn(2, 8).bfloat16()              # a layer's write lands in the stack
    assert torch.equal(k_stack[1, 2, 3], caches[1][0][2, 3])
    assert not v_stack.any()
    mixed = allocate_kv_cache([_attention(2, 8), _attention(1, 8)], 5, 4, torch.bfloat16, torch.device("cpu"))
    assert stacked_kv_cache(mixed) is None
    assert [tuple(k.shape) for k, _ in mixed] == [(5, 4, 2, 8), (5, 4, 1, 8)]


def test_each_layers_repacked_weight_is_stacked_by_rows():
    gen = torch.Generator().manual_seed(0)
    layers = [{"qweight": torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=gen),
               "scales": torch.rand(32, 2, generator=gen).half(), "mins": -torch.rand(32, 2, generator=gen).half()}
              for _ in range(3)]
    codes, pairs = glue._stacked(layers, repacked)
    assert torch.equal(codes, torch.cat([repacked(w)["codes"] for w in layers]))
    assert torch.equal(pairs, torch.cat([repacked(w)["pairs"] for w in layers]))


class _RecordingStep:
    """Stands in for the kernel: the model's final hidden rows from its own chain, and what it was asked."""

    failed = False

    def __init__(self):
        self.chunks, self.calls = None, []

    def __call__(self, model, input_ids, positions, meta):
        self.calls.append((self.chunks, input_ids.tolist(), positions.tolist(), meta.decode_context_lens.tolist()))
        return torch.zeros(len(input_ids), model.norm.weight.shape[0])


def test_a_step_graphs_forward_runs_the_step_with_its_chunk_count_and_the_chain_otherwise():
    from conftest import build_hf_model, make_engine

    model = make_engine(build_hf_model("llama")).engine.runner.model
    step = _RecordingStep()
    model.decode_step = step
    graphs = CudaGraphDecoder(model, 2, 4, torch.device("cpu"), step, max_model_len=64)
    assert graphs.step_chunks == [1]
    graphs.load(_plan([40]))
    logits = graphs._forward((1, 1))
    assert step.calls == [(1, [1], [39], [40])] and step.chunks is None       # the chunk count only while it runs
    assert torch.equal(logits, model.compute_logits(torch.zeros(1, model.model.norm.weight.shape[0])))
    chain = graphs._forward(1)
    assert len(step.calls) == 1 and chain.shape == logits.shape and not torch.equal(chain, logits)
