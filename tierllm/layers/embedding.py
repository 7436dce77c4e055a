"""Token (and learned position) embeddings and the LM head, with their vocab-parallel forms: under tensor
parallelism each rank holds a contiguous slice of the vocabulary (padded to a multiple of tp_size with zero
rows); the embedding masks ids outside its slice and all-reduces, the LM head all-gathers the logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierllm import kernels
from tierllm.distributed.comm import all_gather_last_dim, all_reduce
from tierllm.distributed.parallel_state import ParallelState
from tierllm.distributed.sharding import padded_vocab_size
from tierllm.layers.linear import _new_param, invariant_column_parts, load_whole


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int, vocab_start: int) -> None:
    """Rows [vocab_start, vocab_start + local) of a full [vocab, dim] tensor; rows past the vocabulary are zero."""
    if tuple(loaded.shape) != (vocab_size, param.shape[1]):
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} vs full vocabulary table "
                         f"{(vocab_size, param.shape[1])}")
    num_real = max(0, min(param.shape[0], vocab_size - vocab_start))
    param.data[num_real:].zero_()                               # padding rows
    param.data[:num_real].copy_(loaded[vocab_start:vocab_start + num_real])


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _new_param(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.weight.weight_loader = load_whole

    def forward(self, ids: torch.Tensor) -> torch.Tensor:    # [num_tokens] -> [num_tokens, dim]
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """Rank r holds vocabulary rows [r * V/tp, (r + 1) * V/tp) of the padded vocabulary V; with tp_size=1 it is a
    plain Embedding."""

    def __init__(self, vocab_size: int, embedding_dim: int, dtype: torch.dtype, device, parallel: ParallelState):
        num_local = padded_vocab_size(vocab_size, parallel.tp_size) // parallel.tp_size
        super().__init__(num_local, embedding_dim, dtype, device)
        self.parallel = parallel
        self.vocab_size = vocab_size                            # real (unpadded) vocabulary
        self.vocab_start = parallel.tp_rank * num_local         # first token id held here
        self.weight.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:    # [num_tokens] -> [num_tokens, dim]
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        is_outside = (local < 0) | (local >= self.weight.shape[0])                  # [num_tokens]
        out = F.embedding(local.masked_fill(is_outside, 0), self.weight)            # [num_tokens, dim]
        return all_reduce(out.masked_fill(is_outside[:, None], 0), self.parallel)


class LMHead(nn.Module):
    """Logits from final hidden states; shares the embedding's weight when the model ties them."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, device=None,
                 tied_embedding: Embedding | None = None):
        super().__init__()
        self.tied_embedding = tied_embedding
        if tied_embedding is None:
            self.weight = _new_param(vocab_size, hidden_size, dtype=dtype, device=device)
            self.weight.weight_loader = load_whole
        self.invariant_parts = 0                  # as Linear's: kernels.invariant_linear in invariant mode

    @property
    def dense_weight(self) -> torch.Tensor:
        """[vocab (/ tp), hidden]: the head's own weight, or the tied embedding's."""
        return self.tied_embedding.weight if self.tied_embedding is not None else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        weight = self.dense_weight
        if self.invariant_parts:
            return kernels.invariant_linear(hidden, weight, parts=self.invariant_parts)
        return kernels.linear(hidden, weight)


class ParallelLMHead(LMHead):
    """Vocab-parallel LM head: each rank computes the logits of its vocabulary slice (the same slice as
    VocabParallelEmbedding, so tied weights share it); the slices are all-gathered and the padding cut off."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, device, parallel: ParallelState,
                 tied_embedding: VocabParallelEmbedding | None = None):
        num_local = padded_vocab_size(vocab_size, parallel.tp_size) // parallel.tp_size
        super().__init__(hidden_size, num_local, dtype, device, tied_embedding)
        self.parallel = parallel
        self.invariant_parts = invariant_column_parts(parallel)      # vocab-parallel: a column-parallel matmul
        self.vocab_size = vocab_size
        self.vocab_start = parallel.tp_rank * num_local         # first token id held here
        if tied_embedding is None:
            self.weight.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        return gather_vocab(super().forward(hidden), self.parallel, self.vocab_size)


def gather_vocab(logits: torch.Tensor, parallel: ParallelState, vocab_size: int) -> torch.Tensor:
    """Each rank's logits of its vocabulary slice [num_rows, vocab / tp] -> [num_rows, vocab], padding cut off."""
    if parallel.tp_size == 1:
        return logits
    return all_gather_last_dim(logits, parallel)[:, :vocab_size]
