"""Token selection from logits, with HF's logits-processor semantics: repetition penalty and min-new-tokens
first, then temperature, top-k and top-p for sampling. All rows are decided on the logits' device and come
back to the host in one transfer. Beam requests get their processed log-probs instead.
`sample_on_device` queues that work without waiting for the device (host values reach it through pinned,
non-blocking copies), so the engine can launch the next step before this one's tokens are read."""
from __future__ import annotations

import torch

from tierllm.engine.request import Request
from tierllm.host_copy import to_device
from tierllm.kernels.greedy import greedy_tokens


def _apply_penalties(scores: torch.Tensor, request: Request) -> None:
    """scores: [vocab] logits or log-probs of one request, modified in place."""
    params = request.sampling_params
    if params.repetition_penalty != 1.0:
        seen = to_device(sorted(set(request.all_token_ids)), torch.int64, scores.device)
        picked = scores[seen]
        scores[seen] = torch.where(picked < 0, picked * params.repetition_penalty,
                                   picked / params.repetition_penalty)
    if request.num_output_tokens < params.min_tokens and params.stop_token_ids:
        scores.index_fill_(0, to_device(params.stop_token_ids, torch.int64, scores.device), float("-inf"))


def _needs_penalties(request: Request) -> bool:
    params = request.sampling_params
    return params.repetition_penalty != 1.0 or (request.num_output_tokens < params.min_tokens
                                                and bool(params.stop_token_ids))


def _warp(logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
    """logits: [rows, vocab] fp32 -> filtered logits, as HF's TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper in that order, with each row's own settings (decided on the host: no device sync)."""
    device, vocab = logits.device, logits.shape[-1]
    params = [r.sampling_params for r in rows]
    logits = logits / to_device([p.temperature for p in params], logits.dtype, device)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = to_device(top_k, torch.int64, device)
        kth = torch.topk(logits, max(top_k), dim=-1).values.gather(1, (k - 1)[:, None])   # [rows, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min(p.top_p for p in params) < 1.0:
        top_p = to_device([p.top_p for p in params], logits.dtype, device)
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
        remove[:, -1] = False                                               # keep at least one token
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    return logits


def _exponential_noise(rows: list[Request], vocab: int, device) -> torch.Tensor:
    """Exp(1) noise per row: argmax(probs / noise) is a draw from probs. Seeded rows use their own generator."""
    noise = torch.empty(len(rows), vocab, device=device).exponential_()
    for i, request in enumerate(rows):
        if request.generator is not None:
            noise[i].exponential_(generator=request.generator)
    return noise


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> dict:
    """Log-probs (after penalties, before temperature) of the chosen tokens and the top ones, where asked."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None and not r.is_beam]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index], dim=-1)                   # [rows, vocab]
    chosen = logprobs.gather(1, tokens[index][:, None])[:, 0].tolist()
    k = max(requests[i].sampling_params.logprobs for i in rows)
    top_values, top_ids = (t.tolist() for t in torch.topk(logprobs, k, dim=-1)) if k else ([[]] * len(rows),) * 2
    out = {}
    for j, i in enumerate(rows):
        n = requests[i].sampling_params.logprobs
        out[requests[i].request_id] = (chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def sample_on_device(logits: torch.Tensor, requests: list[Request], out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [num_requests, vocab] -> the next token of every non-beam request [num_requests] (int64, on the
    logits' device; beam rows hold their greedy token), queued without a device sync; written into out when given.
    For requests without beams or log-probs (see `needs_host_sampling`)."""
    if all(r.is_beam or r.sampling_params.is_greedy for r in requests):  # one kernel, on the logits' own dtype
        return greedy_tokens(logits, [_suppressed(r) for r in requests], out)
    tokens = _sample_rows(logits, requests)
    return tokens if out is None else out.copy_(tokens)


def _sample_rows(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """sample_on_device's rows when some request samples: min_tokens' bans, then _choose."""
    logits = logits.float()
    rows, stop_ids = [], []                     # min_tokens: every row's suppressed stop tokens, in one copy
    for i, request in enumerate(requests):
        ids = _suppressed(request)
        rows += [i] * len(ids)
        stop_ids += ids
    if rows:
        index = to_device(rows + stop_ids, torch.int64, logits.device)                  # [2 * suppressed]
        logits.index_put_((index[:len(rows)], index[len(rows):]), logits.new_full((), float("-inf")))
    return _choose(logits, requests)


def _suppressed(request: Request) -> list[int]:
    """The stop tokens a request may not sample yet (min_tokens)."""
    params = request.sampling_params
    return list(params.stop_token_ids) if request.num_output_tokens < params.min_tokens else []


def needs_host_sampling(request: Request) -> bool:
    """Beams and log-probs are decided with host reads (and the repetition penalty needs the request's tokens so
    far): such steps go through `sample`, which waits for the device."""
    params = request.sampling_params
    return request.is_beam or params.logprobs is not None or params.repetition_penalty != 1.0


def _choose(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Penalized fp32 logits [num_requests, vocab] -> greedy or sampled token per row [num_requests]."""
    tokens = logits.argmax(dim=-1)                                          # [num_requests] greedy by default
    sampled = [i for i, r in enumerate(requests) if not r.is_beam and not r.sampling_params.is_greedy]
    if sampled:
        rows = [requests[i] for i in sampled]
        index = to_device(sampled, torch.int64, logits.device)
        probs = _warp(logits.index_select(0, index), rows).softmax(dim=-1)
        tokens[index] = (probs / _exponential_noise(rows, probs.shape[-1], logits.device)).argmax(dim=-1)
    return tokens


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], dict[str, torch.Tensor], dict]:
    """logits: [num_requests, vocab] -> (next token per request, -1 for beam requests; beam log-probs by id;
    token log-probs by id for requests that asked for them)."""
    logits = logits.float()
    beam_logprobs: dict[str, torch.Tensor] = {}
    for i, request in enumerate(requests):
        if request.is_beam:                                                 # HF beams: log_softmax, then processors
            row = torch.log_softmax(logits[i], dim=-1)
            _apply_penalties(row, request)
            beam_logprobs[request.request_id] = row
        elif _needs_penalties(request):
            _apply_penalties(logits[i], request)
    tokens = _choose(logits, requests)
    token_logprobs = _token_logprobs(logits, tokens, requests)
    token_list = tokens.tolist()                                            # the step's one device->host sync
    return [-1 if r.is_beam else t for r, t in zip(requests, token_list)], beam_logprobs, token_logprobs
