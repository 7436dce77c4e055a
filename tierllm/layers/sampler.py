"""Token selection from logits, with HF's logits-processor semantics: repetition penalty and min-new-tokens
first, then temperature, top-k and top-p for sampling. Beam requests get their processed log-probs back."""
from __future__ import annotations

import torch

from tierllm.engine.request import Request


def _apply_penalties(scores: torch.Tensor, request: Request) -> torch.Tensor:
    """scores: [vocab] logits or log-probs of one request (modified in place where needed)."""
    params = request.sampling_params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), device=scores.device)
        picked = scores[seen]
        scores[seen] = torch.where(picked < 0, picked * params.repetition_penalty,
                                   picked / params.repetition_penalty)
    if request.num_output_tokens < params.min_tokens and params.stop_token_ids:
        scores[params.stop_token_ids] = float("-inf")
    return scores


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] fp32 -> filtered logits (HF TemperatureLogitsWarper, TopK, TopP)."""
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[-1] = False                                   # keep at least one token
        logits = logits.masked_fill(remove.scatter(0, sorted_idx, remove), float("-inf"))
    return logits


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """logits: [num_requests, vocab] -> (next token per request, -1 for beam requests; beam log-probs by id)."""
    logits = logits.float()
    tokens = [-1] * len(requests)
    beam_logprobs: dict[str, torch.Tensor] = {}
    plain_greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy and not r.is_beam
                    and r.sampling_params.repetition_penalty == 1.0
                    and (r.num_output_tokens >= r.sampling_params.min_tokens or not r.sampling_params.stop_token_ids)]
    if plain_greedy:                                         # the common case: one argmax for all of them
        picked = logits[plain_greedy].argmax(dim=-1).tolist()
        for i, token in zip(plain_greedy, picked):
            tokens[i] = token
    done = set(plain_greedy)
    for i, request in enumerate(requests):
        if i in done:
            continue
        params = request.sampling_params
        if request.is_beam:
            row = torch.log_softmax(logits[i], dim=-1)
            beam_logprobs[request.request_id] = _apply_penalties(row, request)
            continue
        row = _apply_penalties(logits[i].clone(), request)
        if params.is_greedy:
            tokens[i] = int(row.argmax())
            continue
        probs = torch.softmax(_warp(row, params.temperature, params.top_k, params.top_p), dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=request.generator))
    return tokens, beam_logprobs
