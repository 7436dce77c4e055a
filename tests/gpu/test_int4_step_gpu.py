"""On a Hopper GPU: batch-1 decode through the int4 step kernel (runner/int4_decode_step.py) against the engine's
chain of kernels, in the same engine and on the same KV cache: a llama-7b-shaped int4 model of two layers, its
norms' weights random. Each step kernel graph's logits and cached k and v against the chain graph's at contexts
of every attention chunk count, then eight steps in a row (each reading the k and v the steps before wrote), then
greedy generation through the engine."""
import pytest
import torch
from quant_fixtures import keep_first_configs

import tierllm
from tierllm.runner import int4_decode_step as glue
from tierllm.runner.input_builder import StepPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or glue.device_reason(torch.device("cuda")) is not None,
    reason="needs a Hopper GPU with a multiple of 44 SMs and Triton's Gluon")]

TOLERANCE = 2e-2                 # bf16 chain (bf16 residual between kernels) against the kernel's fp32 residual


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture(scope="module")
def engine():
    """The model built and its graphs captured with each tuned kernel's first config (quant_fixtures)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                         num_hidden_layers=2, vocab_size=2048, max_position_embeddings=2048, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(config).bfloat16()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:                        # not ones: a norm's weight the kernel ignored would show
                param.copy_(1 + 0.2 * torch.randn_like(param))
    with pytest.MonkeyPatch.context() as patch:
        keep_first_configs(patch)
        engine = tierllm.init_inference(hf, dtype=torch.bfloat16, quant="int4", show_progress=False,
                                        max_num_seqs=1, max_model_len=1024)
        del hf
        yield engine


@pytest.fixture
def fresh(engine):
    """The engine with random KV caches (its whole pool); the step kernel on again afterwards."""
    step = engine.model.decode_step
    k_stack, v_stack = step.caches
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_stack.copy_(torch.randn(k_stack.shape, device="cuda", generator=gen))
    v_stack.copy_(torch.randn(v_stack.shape, device="cuda", generator=gen))
    yield engine
    step.failed = False


def _plan(token: int, context: int, table: list[int]) -> StepPlan:
    """A one-token decode step at position context - 1 over the blocks of table."""
    position = context - 1
    slot = table[position // 16] * 16 + position % 16
    return StepPlan([token], [position], [slot], 1, [table[:-(-context // 16)]], [context], [], [], [], [0], [],
                    1 + max(table))


def _cached(engine, slot: int) -> list[torch.Tensor]:
    """Every layer's cached k and v at slot (fp32 [heads head_dim] each)."""
    return [cache.view(-1, cache.shape[-2] * cache.shape[-1])[slot].float().clone()
            for pair in engine.engine.runner.kv_caches for cache in pair]


def test_the_engine_takes_the_step_kernel_for_batch_1(engine):
    graphs = engine.engine.runner.graphs
    assert engine.model.decode_step is not None
    assert graphs.step_chunks == [1, 2, 3, 4]
    assert {(1, c) for c in graphs.step_chunks} <= set(graphs.graphs)


@pytest.mark.parametrize("context", [2, 37, 256, 300, 544, 777, 1024])
def test_each_step_graph_equals_the_chain(fresh, context):
    graphs, step = fresh.engine.runner.graphs, fresh.model.decode_step
    num_blocks = step.caches[0].shape[1]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(context)).tolist()
    plan = _plan(17, context, table)
    key = graphs.key_for(plan)
    assert key == (1, glue.step_chunks(context))
    want = graphs.replay(1, plan).float().clone()
    want_cached = _cached(fresh, plan.slot_mapping[0])
    gave_up = int(step.sync[1])
    for _ in range(2):                                 # both parities of the work buffer
        got = graphs.replay(key, plan).float()
        assert _rel_err(got, want) < TOLERANCE
        for got_row, want_row in zip(_cached(fresh, plan.slot_mapping[0]), want_cached, strict=True):
            assert _rel_err(got_row, want_row) < TOLERANCE
    assert int(step.sync[1]) == gave_up == 0


def test_steps_in_a_row_read_what_the_steps_before_wrote(fresh):
    graphs, step = fresh.engine.runner.graphs, fresh.model.decode_step
    table = list(range(step.caches[0].shape[1]))
    plans = [_plan(token, 500 + i, table) for i, token in enumerate([5, 99, 1000, 7, 2047, 0, 64, 321])]
    before = [t.clone() for t in step.caches]
    want = [graphs.replay(1, plan).float().clone() for plan in plans]
    for cache, saved in zip(step.caches, before, strict=True):
        cache.copy_(saved)
    got = [graphs.run(plan).float().clone() for plan in plans]
    assert [graphs.key_for(plan) for plan in plans] == [(1, 2)] * len(plans)
    errors = [_rel_err(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) < TOLERANCE, errors
    assert int(step.sync[1]) == 0


def test_greedy_generation_replays_the_step_graphs(fresh):
    step = fresh.model.decode_step
    ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
    launches = step.launches
    out = fresh.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert out.shape == (1, 64)
    assert step.launches - launches == 23                 # every decode step after the prefill's token
    step.failed = True                                    # the chain's tokens, for the log
    chain = fresh.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    same = int((out == chain).all(0).long().cumprod(0).sum()) - 40
    print(f"greedy tokens equal to the chain's: the first {same} of 24")
    assert int(step.sync[1]) == 0
