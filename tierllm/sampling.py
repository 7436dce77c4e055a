"""SamplingParams and the translation of HF `generate` keyword arguments into them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16                      # new tokens at most
    min_tokens: int = 0                       # EOS/stop tokens are suppressed before this many
    temperature: float = 1.0                  # 0 = greedy
    top_k: int = 0                            # 0 = off
    top_p: float = 1.0                        # 1 = off
    repetition_penalty: float = 1.0           # HF/CTRL-style, over prompt and output tokens
    do_sample: bool = False                   # False = greedy (argmax)
    seed: int | None = None                   # per-request generator seed
    stop_token_ids: list[int] = field(default_factory=list)  # EOS ids and any other stop ids
    ignore_eos: bool = False                  # keep going past stop tokens (benchmarks)
    n: int = 1                                # independent samples per prompt
    num_beams: int = 1                        # >1 = beam search
    length_penalty: float = 1.0               # beam search: score = logprob_sum / len**length_penalty
    early_stopping: bool | str = False        # beam search: True | False | "never" (HF semantics)
    logprobs: int | None = None               # return the sampled token's log-prob and this many top ones

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_new_tokens/max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_new_tokens must be between 0 and max_new_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.n < 1 or self.num_beams < 1:
            raise ValueError("n/num_return_sequences and num_beams must be >= 1")
        if self.num_beams > 1:
            if self.do_sample:
                raise ValueError("num_beams > 1 with do_sample=True (beam sampling) is not supported: "
                                 "use do_sample=False for beam search, or num_beams=1 to sample")
            if self.n > self.num_beams:
                raise ValueError(f"num_return_sequences ({self.n}) must be <= num_beams ({self.num_beams})")
            if self.early_stopping not in (True, False, "never"):
                raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        elif self.n > 1 and not self.do_sample:
            raise ValueError(f"num_return_sequences={self.n} with greedy decoding would return {self.n} identical "
                             "rows: set do_sample=True or num_beams >= num_return_sequences")


_HF_UNSUPPORTED = ("num_beam_groups", "diversity_penalty", "constraints", "force_words_ids", "penalty_alpha",
                   "typical_p", "epsilon_cutoff", "eta_cutoff", "assistant_model", "prompt_lookup_num_tokens",
                   "guidance_scale", "low_memory", "output_scores", "return_dict_in_generate")


def sampling_params_from_hf(*, max_new_tokens: int | None = None, min_new_tokens: int = 0, do_sample: bool = False,
                            temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                            repetition_penalty: float = 1.0, eos_token_id: int | list[int] | None = None,
                            num_beams: int = 1, num_return_sequences: int = 1, length_penalty: float = 1.0,
                            early_stopping: bool | str = False, seed: int | None = None,
                            **unsupported) -> SamplingParams:
    """HF `generate` arguments -> SamplingParams. HF defaults: top_k=50 only when sampling and not given."""
    bad = sorted(set(unsupported))
    if bad:
        known = [k for k in bad if k in _HF_UNSUPPORTED]
        hint = " (these HF options are not supported)" if known else ""
        raise ValueError(f"unsupported generate() arguments {bad}{hint}; supported: max_new_tokens, min_new_tokens, "
                         "do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id, pad_token_id, "
                         "num_beams, num_return_sequences, length_penalty, early_stopping, seed")
    if max_new_tokens is None:
        raise ValueError("max_new_tokens is required")
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    return SamplingParams(
        max_tokens=max_new_tokens, min_tokens=min_new_tokens, do_sample=do_sample,
        temperature=temperature, top_k=(50 if top_k is None and do_sample else (top_k or 0)), top_p=top_p,
        repetition_penalty=repetition_penalty, stop_token_ids=eos, num_beams=num_beams, n=num_return_sequences,
        length_penalty=length_penalty, early_stopping=early_stopping, seed=seed)
