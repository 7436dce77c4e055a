"""Weight offload on CPU: streamed layers (pinned-CPU and NVMe tiers) give the resident engine's greedy tokens,
with overlapped steps; bad budgets and corrupt layer files give clear errors."""
from __future__ import annotations

import glob
import os

import pytest
import torch

import tierllm
from conftest import build_hf_model, left_pad, make_engine, random_prompts

FAMILIES = ["llama_gqa", "opt", "gpt2"]


def _batch():
    return left_pad(random_prompts([5, 17, 30, 9], seed=3), pad=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_resident", [0, 1])
def test_cpu_tier_matches_resident(family, num_resident, family_engine):
    ids, mask = _batch()
    expected = family_engine(family).generate(ids, attention_mask=mask, max_new_tokens=12)
    engine = make_engine(build_hf_model(family),
                         offload=tierllm.OffloadConfig(device="cpu", num_resident_layers=num_resident))
    streamer = engine.model.layer_streamer
    assert streamer.order == list(range(num_resident, 2))          # the tiny models have 2 layers
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert got.tolist() == expected.tolist()
    assert engine.engine.num_overlapped_steps > 0          # streamed steps overlap: the next one queued early


def test_prefetch_depth_and_more_layers_than_slots():
    """4 layers through 2 slots (prefetch 1) and through 3 slots (prefetch 2): slots are reused in turn."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                      initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = _batch()
    expected = make_engine(model).generate(ids, attention_mask=mask, max_new_tokens=10)
    for prefetch in (1, 2):
        offload = tierllm.OffloadConfig(num_resident_layers=1, prefetch_layers=prefetch)
        engine = make_engine(model, offload=offload)
        assert len(engine.model.layer_streamer.slots) == prefetch + 1
        assert engine.generate(ids, attention_mask=mask, max_new_tokens=10).tolist() == expected.tolist()


def test_nvme_tier_matches_resident(tmp_path, family_engine):
    ids, mask = _batch()
    expected = family_engine("llama_gqa").generate(ids, attention_mask=mask, max_new_tokens=12)
    offload = tierllm.OffloadConfig(device="nvme", nvme_path=str(tmp_path), num_resident_layers=0)
    engine = make_engine(build_hf_model("llama_gqa"), offload=offload)
    assert len(glob.glob(str(tmp_path / "*" / "layer-*.bin"))) == 2
    assert engine.generate(ids, attention_mask=mask, max_new_tokens=12).tolist() == expected.tolist()
    assert engine.engine.num_overlapped_steps > 0
    engine.model.layer_streamer.close()
    assert os.listdir(tmp_path) == []                               # the layer files are removed on close


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_nvme_file_is_a_clear_error(tmp_path, damage):
    offload = tierllm.OffloadConfig(device="nvme", nvme_path=str(tmp_path), num_resident_layers=0)
    engine = make_engine(build_hf_model("llama_gqa"), offload=offload)
    path = sorted(glob.glob(str(tmp_path / "*" / "layer-*.bin")))[1]
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        else:
            f.truncate(4096)
    ids, mask = _batch()
    for _ in range(2):                                              # and again: never garbage after an error
        with pytest.raises(RuntimeError, match="corrupt|truncated") as info:
            engine.generate(ids, attention_mask=mask, max_new_tokens=4)
        assert path in str(info.value) and "reload the model" in str(info.value).lower()
        assert engine.engine.block_manager.num_used_blocks == 0     # the failed requests were aborted


def test_gpu_budget_below_one_layer_names_the_minimum():
    with pytest.raises(ValueError, match=r"too small: the minimum is [0-9.]+ GiB"):
        make_engine(build_hf_model("llama_gqa"), offload=tierllm.OffloadConfig(max_gpu_memory="64KiB"))


def test_budget_decides_how_many_layers_stay_resident():
    """Without num_resident_layers, the plan keeps as many layers resident as fit after the embeddings, the
    activations, the staging slots and the full KV demand; a roomy budget streams nothing."""
    from tierllm.offload.placement import plan_placement
    mib = 2 ** 20
    layers = torch.nn.ModuleList(torch.nn.Linear(512, 256, bias=False) for _ in range(8))   # 0.5 MiB each (fp32)
    kwargs = dict(fixed_bytes=mib, kv_bytes_per_token=1024, max_num_seqs=4, max_model_len=256,
                  max_num_batched_tokens=16, vocab_size=16, dtype=torch.float32)       # KV demand 1 MiB
    offload = tierllm.OffloadConfig(prefetch_layers=1)
    plan = plan_placement(layers, offload=offload, gpu_budget=64 * mib, **kwargs)
    assert plan.offloaded_layers == [] and plan.tier == "none" and plan.staging_bytes == 0
    plan = plan_placement(layers, offload=offload, gpu_budget=5 * mib, **kwargs)
    # 5 MiB - 1 fixed - ~0.1 activations - 1 staging (2 slots) - 1 KV -> 3 resident layers (1.5 MiB)
    assert plan.resident_layers == [0, 1, 2] and plan.offloaded_layers == [3, 4, 5, 6, 7]
    assert plan.num_slots == 2 and plan.staging_bytes == mib and plan.tier == "cpu"
    assert plan.max_batch(256) == plan.kv_cache_bytes // (1024 * 256) >= 4
    assert "5 offloaded decoder layers (cpu)" in plan.describe(256)


def test_offload_config_validation():
    with pytest.raises(ValueError, match="nvme_path"):
        tierllm.OffloadConfig(device="nvme")
    with pytest.raises(ValueError, match="'cpu' or 'nvme'"):
        tierllm.OffloadConfig(device="disk")
    with pytest.raises(ValueError, match="as a size"):
        tierllm.OffloadConfig(max_gpu_memory="lots")


@pytest.mark.parametrize("quant", ["int8", {"bits": 4, "lm_head": True}, "w8a8"], ids=["int8", "int4-head8", "w8a8"])
def test_quantized_layers_stream_quantized(quant, tmp_path):
    """Quantized offload: the packed int8/int4 tensors (not dense weights) are what is stored and copied, and the
    tokens equal the resident quantized engine's (int4 with an int8 LM head, which stays on the device)."""
    from tierllm.layers.quant_linear import QuantLinear
    from tierllm.offload.placement import module_bytes
    model = build_hf_model("llama_gqa")
    ids, mask = _batch()
    resident = make_engine(model, quant=quant)
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=10)
    for offload in (tierllm.OffloadConfig(num_resident_layers=0),
                    tierllm.OffloadConfig(device="nvme", nvme_path=str(tmp_path), num_resident_layers=0)):
        engine = make_engine(model, quant=quant, offload=offload)
        layer = engine.model.decoder_layers()[0]
        assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
        packed = engine.model.layer_streamer.store.layouts[0].nbytes
        assert packed < module_bytes(make_engine(model).model.decoder_layers()[0]) / 2   # quantized bytes move
        assert engine.generate(ids, attention_mask=mask, max_new_tokens=10).tolist() == expected.tolist()
        engine.close()


def test_planned_kv_pool_holds_max_num_seqs_full_requests(preempt_counter):
    """The plan reserves whole blocks per request: max_num_seqs requests of max_model_len tokens (35, not a
    multiple of the 16-token block) run together without preemption."""
    model = build_hf_model("llama_gqa")
    engine = make_engine(model, offload=tierllm.OffloadConfig(num_resident_layers=0), num_kv_blocks=None,
                         max_num_seqs=4, max_model_len=35)
    assert engine.engine.block_manager.num_blocks >= 4 * 3
    ids, mask = left_pad(random_prompts([30, 30, 30, 30], seed=9), pad=0)
    engine.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
    assert preempt_counter == []
