"""Beam search over copy-on-write KV blocks, step for step the algorithm of HF transformers' `_beam_search`
(one prompt; HF runs each prompt of a batch independently, so per-prompt groups give the same beams).

The group owns `num_beams` beam requests (slots). Each step it takes the processed log-probs of every running
beam, keeps the best continuations, and tells the engine which slot now continues which parent; the engine
forks the parents' block tables (shared blocks, reference counted) so no KV is copied except the last
partial block, on its next write.
"""
from __future__ import annotations

import torch

from tierllm.sampling import SamplingParams


class BeamSearchGroup:
    def __init__(self, prompt_len: int, params: SamplingParams, eos_token_ids: list[int]):
        self.num_beams = params.num_beams                       # beams kept running
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.eos_token_ids = set(eos_token_ids)                  # EOS ids end a hypothesis
        self.num_return = params.n
        self.prompt_len = prompt_len
        self.max_length = prompt_len + params.max_tokens         # HF max_length
        self.cur_len = prompt_len
        self.beams_to_keep = max(2, 1 + len(eos_token_ids)) * self.num_beams
        nb = self.num_beams
        self.top_num_beam_mask = torch.zeros(self.beams_to_keep, dtype=torch.bool)
        self.top_num_beam_mask[:nb] = True
        self.running_tokens: list[list[int]] = [[] for _ in range(nb)]   # generated tokens per running beam
        self.running_scores = torch.full((1, nb), -1.0e9)                # [1, num_beams] summed log-probs
        self.running_scores[0, 0] = 0.0
        self.finished_tokens: list[list[int]] = [[] for _ in range(nb)]  # best finished hypotheses
        self.finished_scores = torch.full((1, nb), -1.0e9)               # length-penalised scores
        self.is_finished = torch.zeros((1, nb), dtype=torch.bool)
        self.improvement_possible = torch.ones((1, 1), dtype=torch.bool)
        self.is_done = False

    def step(self, log_probs: torch.Tensor) -> list[int]:
        """log_probs: [num_beams or 1, vocab] processed log-probs of the running beams (one row before the first
        selection). Returns, per slot, the index of the parent slot it continues."""
        nb = self.num_beams
        log_probs = log_probs.float().cpu()
        vocab = log_probs.shape[-1]
        if log_probs.shape[0] == 1:
            log_probs = log_probs.expand(nb, vocab)
        scores = (log_probs + self.running_scores[0, :, None]).reshape(1, nb * vocab)   # [1, nb * vocab]
        topk_scores, topk_idx = torch.topk(scores, k=self.beams_to_keep)                # [1, K]
        parents = (topk_idx // vocab)[0].tolist()
        tokens = (topk_idx % vocab)[0].tolist()
        cand_tokens = [self.running_tokens[p] + [t] for p, t in zip(parents, tokens)]
        at_max_len = self.cur_len + 1 >= self.max_length
        hits_stop = torch.tensor([[at_max_len or t in self.eos_token_ids for t in tokens]])   # [1, K]

        # running beams for the next step: best candidates that did not stop
        running_cand = topk_scores + hits_stop.float() * -1.0e9
        next_idx = torch.topk(running_cand, k=nb)[1][0].tolist()
        self.running_scores = running_cand[:, next_idx]
        slot_parents = [parents[i] for i in next_idx]
        self.running_tokens = [cand_tokens[i] for i in next_idx]

        # finished hypotheses: merge the newly stopped top-num_beams candidates with the old ones
        just_finished = hits_stop & self.top_num_beam_mask[None, :]
        final_scores = topk_scores / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        all_full = bool(self.is_finished.all()) and self.early_stopping is True
        final_scores = final_scores + float(all_full) * -1.0e9
        final_scores = final_scores + (~self.improvement_possible).float() * -1.0e9
        final_scores = final_scores + (~just_finished).float() * -1.0e9
        merged_scores = torch.cat((self.finished_scores, final_scores), dim=1)
        merged_tokens = self.finished_tokens + cand_tokens
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        keep = torch.topk(merged_scores, k=nb)[1][0].tolist()
        self.finished_scores = merged_scores[:, keep]
        self.finished_tokens = [merged_tokens[i] for i in keep]
        self.is_finished = merged_finished[:, keep]

        self.cur_len += 1
        self._update_improvement_possible()
        exists_open_beam = not (bool(self.is_finished.all()) and self.early_stopping is True)
        valid_continuations = not bool(hits_stop.all())
        self.is_done = not (bool(self.improvement_possible.any()) and exists_open_beam and valid_continuations)
        return slot_parents

    def _update_improvement_possible(self) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (best_len ** self.length_penalty)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(dim=1, keepdim=True)[0], -1.0e9)
        self.improvement_possible = self.improvement_possible & torch.any(best_running > worst_finished, dim=-1,
                                                                          keepdim=True)

    def results(self) -> list[list[int]]:
        """Generated tokens of the best `n` hypotheses, best first."""
        return self.finished_tokens[: self.num_return]
