"""User API: init_inference(...) -> InferenceEngine (HF-style generate), and the offline LLM class."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tierllm.config import CacheConfig, EngineConfig, OffloadConfig, QuantConfig, SchedulerConfig, parse_bytes
from tierllm.default_model import DEFAULT_MODEL_NAME, default_model_path
from tierllm.distributed.comm import min_over_ranks
from tierllm.distributed.driver import serve_worker
from tierllm.distributed.launch import released_on_error, start_tensor_parallel
from tierllm.distributed.parallel_state import ParallelConfig, ParallelState
from tierllm.engine.block_manager import BlockManager
from tierllm.engine.llm_engine import LLMEngine
from tierllm.engine.outputs import RequestOutput
from tierllm.engine.scheduler import Scheduler
from tierllm.models.hf_fallback import HFFallbackEngine, build_fallback_engine, fallback_reason
from tierllm.models.registry import resolve_model_class
from tierllm.offload.offload_model import gpu_budget_bytes, offload_model, plan_for_model, throughput_token_budget
from tierllm.offload.kv_offload import KVOffload, host_kv_blocks
from tierllm.offload.placement import module_bytes
from tierllm.quant.quantize import quantize_model
from tierllm.quant.saved import load_prequantized
from tierllm.runner.int4_decode_step import attach_int4_decode_step
from tierllm.runner.kv_cache import bytes_per_block, plan_num_blocks
from tierllm.runner.model_runner import ModelRunner
from tierllm.sampling import SamplingParams, sampling_params_from_hf
from tierllm.weights.checkpoint import open_checkpoint
from tierllm.weights.loader import load_weights

logger = logging.getLogger("tierllm")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _load_tokenizer(source):
    if source is None:
        return None
    from transformers import AutoTokenizer
    path, kwargs = source
    return AutoTokenizer.from_pretrained(path, **kwargs)


def _generation_default(checkpoint, name: str):
    """EOS / pad id as HF generate would take it: generation_config first, then the model config."""
    value = getattr(checkpoint.generation_config, name, None) if checkpoint.generation_config is not None else None
    return value if value is not None else getattr(checkpoint.config, name, None)


def _as_list(ids) -> list[int]:
    return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))


def run_to_completion(engine: LLMEngine, request_ids: list[str], prompts: list[list[int]],
                      params: SamplingParams) -> Iterator[list[tuple[int, RequestOutput]]]:
    """Submit the prompts and step until all are done, yielding each step's (prompt index, output) pairs.
    Whatever is left (an error, an abandoned iteration) is aborted, so its KV blocks are freed."""
    index = {rid: i for i, rid in enumerate(request_ids)}
    try:
        for rid, prompt in zip(request_ids, prompts):
            engine.add_request(rid, prompt, params)
        while any(rid in engine.groups for rid in request_ids):
            yield [(index[o.request_id], o) for o in engine.step() if o.request_id in index]
    finally:
        for rid in request_ids:
            engine.abort(rid)


def encode_prompt(tokenizer, prompt: str, use_chat_template: bool) -> list[int]:
    """Text -> token ids, optionally as one user turn of the model's chat template."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids, or tokenizer=... when loading")
    if use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: send the prompt as raw text")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer.encode(prompt)


@dataclass
class GenerationProfile:
    """Timing of the last generate() call, by the reference formulas (ZeRO-Inference)."""
    batch_size: int                  # sequences generated
    prompt_tokens: int               # prompt tokens over all rows
    generated_tokens: int            # new tokens over all rows
    prefill_latency_s: float         # until every row has its first token
    decode_latency_s: float          # the rest
    total_latency_s: float

    @property
    def prefill_throughput(self) -> float:   # batch * prompt_len / prefill_latency
        return self.prompt_tokens / self.prefill_latency_s if self.prefill_latency_s else 0.0

    @property
    def decode_throughput(self) -> float:    # batch * (gen_len - 1) / decode_latency
        decode_tokens = self.generated_tokens - self.batch_size
        return decode_tokens / self.decode_latency_s if self.decode_latency_s > 0 else 0.0

    @property
    def total_throughput(self) -> float:     # batch * gen_len / total_latency
        return self.generated_tokens / self.total_latency_s if self.total_latency_s else 0.0

    def as_dict(self) -> dict:
        return {"batch_size": self.batch_size, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "prefill_latency_s": self.prefill_latency_s,
                "decode_latency_s": self.decode_latency_s, "total_latency_s": self.total_latency_s,
                "prefill_tokens_per_s": self.prefill_throughput, "decode_tokens_per_s": self.decode_throughput,
                "total_tokens_per_s": self.total_throughput}


class InferenceEngine:
    """What init_inference returns: HF-style generate() over the tierllm engine."""

    def __init__(self, engine: LLMEngine, tokenizer, default_eos: list[int], pad_token_id: int | None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.default_eos = default_eos
        self.default_pad = pad_token_id
        self.profile: GenerationProfile | None = None
        self._first_token_time: float | None = None
        self._ids = itertools.count()

    @property
    def model(self):
        return self.engine.runner.model

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism); also done at interpreter exit."""
        self.engine.close()

    def _prepare(self, input_ids, attention_mask, kwargs):
        """-> (ids [batch, seq], mask [batch, seq], prompts without padding, SamplingParams, pad id)"""
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None, :]
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, seq_len] tensor, got shape {tuple(ids.shape)}")
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(ids.shape)}")
        kwargs = dict(kwargs)
        pad = kwargs.pop("pad_token_id", None)
        kwargs.setdefault("eos_token_id", self.default_eos or None)
        params = sampling_params_from_hf(**kwargs)
        pad = pad if pad is not None else (self.default_pad if self.default_pad is not None else
                                           (params.stop_token_ids[0] if params.stop_token_ids else 0))
        prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
        for prompt in prompts:
            self.engine.validate_request(prompt, params)
        return ids, mask, prompts, params, pad

    def _run(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[list[tuple[int, RequestOutput]]]:
        """run_to_completion, also setting self._first_token_time once every row has its first token."""
        rids = [f"generate-{next(self._ids)}" for _ in prompts]
        groups = self.engine.groups
        self._first_token_time = None
        steps = run_to_completion(self.engine, rids, prompts, params)
        try:
            for outputs in steps:
                if self._first_token_time is None and all(
                        rid not in groups or any(c.num_output_tokens for c in groups[rid].children) for rid in rids):
                    self._first_token_time = time.perf_counter()
                yield outputs
        finally:
            steps.close()                             # a consumer that stops early aborts the rest

    def generate(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """HF `generate` for decoder-only models: returns [batch * num_return_sequences, prompt + new] token ids,
        each row the input row followed by its new tokens, padded with pad_token_id (right-padded input rows get
        their new tokens right after their last real token)."""
        ids, mask, prompts, params, pad = self._prepare(input_ids, attention_mask, kwargs)
        results: dict[int, list[list[int]]] = {}
        start = time.perf_counter()
        for step_outputs in self._run(prompts, params):
            for row, output in step_outputs:
                if output.finished:
                    results[row] = [c.token_ids for c in output.outputs]
        total = time.perf_counter() - start
        prefill = (self._first_token_time or start + total) - start
        generated = sum(len(t) for r in results.values() for t in r)
        self.profile = GenerationProfile(len(prompts) * params.n, sum(len(p) for p in prompts) * params.n,
                                         generated, prefill, total - prefill, total)
        return self._assemble(ids, mask, results, pad)

    @staticmethod
    def _assemble(ids: torch.Tensor, mask: torch.Tensor, results: dict[int, list[list[int]]], pad: int):
        width = ids.shape[1] + max((len(t) for r in results.values() for t in r), default=0)
        rows = []
        for i in range(ids.shape[0]):
            is_right_padded = bool(mask[i, -1] == 0)
            base = ids[i][mask[i].bool()].tolist() if is_right_padded else ids[i].tolist()
            for tokens in results[i]:
                row = base + tokens
                rows.append(row + [pad] * (width - len(row)))
        return torch.tensor(rows, dtype=ids.dtype, device=ids.device)          # on the input's device, as HF

    def generate_stream(self, input_ids, attention_mask=None, **kwargs) -> Iterator[list[list[int]]]:
        """Yields, after each engine step that produced tokens, the new tokens of every output row
        ([] for rows without news). Beam search reports its beams once, at the end."""
        _, _, prompts, params, _ = self._prepare(input_ids, attention_mask, kwargs)
        num_out = params.n
        seen = [0] * (len(prompts) * num_out)
        for step_outputs in self._run(prompts, params):
            news = [[] for _ in seen]
            for row, output in step_outputs:
                for c in output.outputs:
                    k = row * num_out + c.index
                    news[k] = c.token_ids[seen[k]:]
                    seen[k] = len(c.token_ids)
            if any(news):
                yield news


def _load_native_model(checkpoint, model_cls, max_len: int, dtype: torch.dtype, parallel, device: torch.device,
                       is_offloaded: bool, quant, show_progress: bool):
    """Build the native model and fill it: a folder written by `tierllm quantize` fills QuantLinear shells (never
    quantizes again); any other checkpoint loads dense weights, quantized afterwards if `quant` is given. A model
    to offload is built on the CPU (offload_model places it)."""
    is_prequantized = checkpoint.quant_config is not None
    if is_prequantized and parallel.tp_size > 1:
        raise ValueError("a folder written by `tierllm quantize` holds whole (unsharded) tensors, which tensor "
                         "parallelism cannot load: load the original model with quant=... instead (each rank "
                         "then quantizes its own shard)")
    native = model_cls(checkpoint.config, max_len, dtype, parallel=parallel,
                       device=torch.device("cpu") if is_offloaded or is_prequantized else device)
    if is_prequantized:
        load_prequantized(native, checkpoint, quant, show_progress)
        if not is_offloaded:
            native.to(device)
    else:
        load_weights(native, checkpoint, show_progress)
        if quant is not None:
            quantize_model(native, QuantConfig.from_any(quant), show_progress, max_len=max_len)
    return native.eval()


_INVARIANT_QUANT_ERROR = ("tensor_parallel invariant=True computes with unquantized weights only: drop quant (or load "
                          "the unquantized checkpoint), or drop invariant")


def build_engine(model=None, *, dtype=None, device=None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 enable_cuda_graph: bool | None = None, scheduler_policy: str = "splitfuse",
                 show_progress: bool = True, offload: OffloadConfig | dict | None = None,
                 kv_offload: bool = False, pin_kv_cache: bool = True, async_kv_offload: bool = True,
                 quant: QuantConfig | dict | str | None = None, tensor_parallel: dict | int | None = None,
                 mixed_graph_tokens: int = 0, overlap_steps: bool = True):
    """Load weights into the native model and size the KV cache. Returns (LLMEngine, tokenizer, eos, pad).
    enable_cuda_graph: replay captured graphs for pure-decode steps (default: on for CUDA devices).
    mixed_graph_tokens: with CUDA graphs, also capture steps that carry up to this many prompt tokens (SplitFuse's
    mixed steps; capped at max_num_batched_tokens), whose eager launches otherwise take longer than the GPU's work
    for small budgets; 0 (default): they run eagerly. `tierllm serve` uses 512.
    tensor_parallel: {"tp_size": N} splits every layer over N processes (N GPUs): under torchrun each rank joins
    the job (ranks > 0 then serve rank 0's steps inside this call and exit when it shuts down, never returning);
    otherwise this process is rank 0 and spawns N-1 workers. See tierllm/distributed/launch.py. {"tp_size": N,
    "invariant": True}: bitwise the same outputs at tp sizes 1, 2, 4 and 8 (kernels/invariant_linear.py; slower).
    max_num_batched_tokens: token budget per step (default 2048; with offload, as many as the GPU budget's
    activations allow, so one pass over the streamed layers serves a whole batch of prompts).
    offload: an OffloadConfig (or its fields as a dict) to stream decoder layers from pinned CPU memory or NVMe.
    kv_offload: keep the KV pool in host memory (pinned if pin_kv_cache; kv_cache_memory bytes, default 40% of
    RAM) and bring each layer's blocks over per step (asynchronously, a layer ahead, if async_kv_offload) or attend
    on the CPU, whichever is cheaper: the batch is then bounded by host memory.
    quant: a QuantConfig (or its fields as a dict, or "int8" | "int4" | "w8a8") to quantize the decoder layers'
    linears after loading; a folder written by `tierllm quantize` loads quantized without it.
    overlap_steps: schedule and launch the next decode step while the device still runs this one (see
    engine/llm_engine.py); False waits for every step's tokens first."""
    engine_args = dict(locals())                  # this call's arguments: spawned tensor-parallel workers repeat it
    if (quant is not None and QuantConfig.from_any(quant).method == "gptq" and tensor_parallel is not None
            and not isinstance(tensor_parallel, ParallelState)
            and ParallelConfig.from_any(tensor_parallel).tp_size > 1):
        raise ValueError("quant method 'gptq' does not support tensor parallelism: use method 'rtn' (each rank "
                         "quantizes its own shard), or run GPTQ without tensor_parallel")
    if (quant is not None and tensor_parallel is not None and not isinstance(tensor_parallel, ParallelState)
            and ParallelConfig.from_any(tensor_parallel).invariant):
        raise ValueError(_INVARIANT_QUANT_ERROR)
    source = default_model_path() if model is None else model
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    parallel, source = start_tensor_parallel(tensor_parallel, device, source, engine_args)
    device = parallel.device                      # this rank's device
    with released_on_error(parallel):             # a failed build leaves no workers or process group behind
        torch_dtype = _resolve_dtype(dtype, device)
        checkpoint = open_checkpoint(source)
        config = checkpoint.config
        model_cls = resolve_model_class(config)
        context = config.max_position_embeddings
        if max_model_len is not None and max_model_len > context:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({context})")
        max_len = max_model_len or context
        if (max_num_batched_tokens is not None and max_num_batched_tokens < 1) or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        offload = OffloadConfig(**offload) if isinstance(offload, dict) else offload
        native = _load_native_model(checkpoint, model_cls, max_len, torch_dtype, parallel, device,
                                    is_offloaded=offload is not None, quant=quant, show_progress=show_progress)
        if parallel.invariant_parts and any(hasattr(m, "qweight") for m in native.modules()):
            raise ValueError(_INVARIANT_QUANT_ERROR)                 # a folder saved by `tierllm quantize`
        if enable_cuda_graph is not False and offload is None and not kv_offload and parallel.tp_size == 1:
            attach_int4_decode_step(native, torch_dtype, device, block_size)   # before the KV cache takes the rest
        block_bytes = bytes_per_block(native.attention_layers(), block_size, torch_dtype)
        # with KV offload the GPU holds two layers' working buffers of the pool, not every layer's blocks
        gpu_block_bytes = 2 * block_bytes // len(native.attention_layers()) if kv_offload else block_bytes
        if offload is not None:
            gpu_budget = gpu_budget_bytes(offload, device, gpu_memory_utilization,
                                          module_bytes(native) + (parse_bytes(kv_cache_memory) or 1 << 30) + (1 << 30))
            if max_num_batched_tokens is None:
                max_num_batched_tokens = throughput_token_budget(native, gpu_budget, max_num_seqs * max_len,
                                                                 torch_dtype)
            plan = plan_for_model(native, offload, gpu_budget, gpu_block_bytes // block_size, max_num_seqs, max_len,
                                  max_num_batched_tokens, torch_dtype, block_size)
            offload_model(native, plan, offload, device, show_progress)
            num_kv_blocks = num_kv_blocks or plan.kv_cache_bytes // gpu_block_bytes
            if plan.offloaded_layers:
                if enable_cuda_graph:
                    logger.info("tierllm: CUDA graphs are off while layers stream (the step is bound by the copies)")
                enable_cuda_graph = False
        max_num_batched_tokens = max_num_batched_tokens or 2048
        cache_config = CacheConfig(block_size, num_kv_blocks, parse_bytes(kv_cache_memory), gpu_memory_utilization,
                                   enable_prefix_caching)
        sched_config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_len, scheduler_policy)
        engine_config = EngineConfig(str(source) if model is not None else DEFAULT_MODEL_NAME, str(torch_dtype),
                                     str(device), cache_config, sched_config)
        num_blocks = plan_num_blocks(cache_config, sched_config, gpu_block_bytes, device)
        if kv_offload:                            # the ranks of a host share its memory
            num_blocks = min(num_blocks, host_kv_blocks(cache_config, sched_config, block_bytes, parallel.tp_size))
        num_blocks = min_over_ranks(num_blocks, parallel)
        kv = None
        if kv_offload:
            kv = KVOffload(native.attention_layers(), num_blocks, block_size, torch_dtype, device,
                           native.layer_streamer, pin_kv_cache, async_kv_offload)
            enable_cuda_graph = False
        if enable_cuda_graph is None:
            enable_cuda_graph = device.type == "cuda"
        if mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be >= 0 (0 = off), got {mixed_graph_tokens}")
        runner = ModelRunner(native, num_blocks, block_size, torch_dtype, device, enable_cuda_graph, max_num_seqs,
                             max_len, kv, parallel, min(mixed_graph_tokens, max_num_batched_tokens))
        if not parallel.is_driver:
            serve_worker(runner)                      # tensor-parallel ranks > 0: follow rank 0's steps, then exit
        scheduler = Scheduler(sched_config, BlockManager(num_blocks, block_size, enable_prefix_caching,
                                                         prefer_low_ids=kv_offload))
        engine = LLMEngine(engine_config, scheduler, runner, config.vocab_size, overlap_steps)
        logger.info("tierllm: %s on %s (%s), %d KV blocks of %d tokens", type(native).__name__, device, torch_dtype,
                    num_blocks, block_size)
        tokenizer = _load_tokenizer(checkpoint.tokenizer_source)
        eos = _as_list(_generation_default(checkpoint, "eos_token_id"))
        return engine, tokenizer, eos, _generation_default(checkpoint, "pad_token_id")


def init_inference(model=None, *, tokenizer=None, replace_with_kernel_inject: bool = True,
                   **engine_kwargs) -> InferenceEngine | HFFallbackEngine:
    """Load `model` (HF folder, .gguf file, or transformers model object; None = the embedded SmolLM2) and
    return an InferenceEngine with HF-style generate(). See build_engine for the engine options.
    A model with no native implementation, or replace_with_kernel_inject=False, runs through its HF modules and
    HF generate instead (with layer streaming when `offload` is given); the log says kernels were not injected."""
    reason = fallback_reason(model, replace_with_kernel_inject)
    if reason is not None:
        return build_fallback_engine(model, tokenizer, reason, **engine_kwargs)
    engine, loaded_tokenizer, eos, pad = build_engine(model, **engine_kwargs)
    return InferenceEngine(engine, tokenizer or loaded_tokenizer, eos, pad)


class LLM:
    """Offline batch generation: prompts (text or token ids) + SamplingParams -> RequestOutputs with text."""

    def __init__(self, model=None, *, tokenizer=None, **engine_kwargs):
        self.engine, loaded_tokenizer, self.default_eos, _ = build_engine(model, **engine_kwargs)
        self.tokenizer = tokenizer or loaded_tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str, use_chat_template: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, use_chat_template)

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism); also done at interpreter exit."""
        self.engine.close()

    def generate(self, prompts, sampling_params: SamplingParams | None = None,
                 use_chat_template: bool = False) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        if not params.stop_token_ids and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=list(self.default_eos))
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.encode(p, use_chat_template) if isinstance(p, str) else list(p) for p in prompts]
        for tokens in token_lists:
            self.engine.validate_request(tokens, params)
        rids = [f"llm-{next(self._ids)}" for _ in token_lists]
        outputs: list[RequestOutput | None] = [None] * len(token_lists)
        for step_outputs in run_to_completion(self.engine, rids, token_lists, params):
            for i, output in step_outputs:
                if output.finished:
                    outputs[i] = output
        if self.tokenizer is not None:
            for output in outputs:
                for completion in output.outputs:
                    completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return outputs
