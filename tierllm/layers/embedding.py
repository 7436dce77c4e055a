"""Token (and learned position) embeddings and the LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierllm import kernels
from tierllm.layers.linear import _new_param, load_whole


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _new_param(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.weight.weight_loader = load_whole

    def forward(self, ids: torch.Tensor) -> torch.Tensor:    # [num_tokens] -> [num_tokens, dim]
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Logits from final hidden states; shares the embedding's weight when the model ties them."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, device=None,
                 tied_embedding: Embedding | None = None):
        super().__init__()
        self.tied_embedding = tied_embedding
        if tied_embedding is None:
            self.weight = _new_param(vocab_size, hidden_size, dtype=dtype, device=device)
            self.weight.weight_loader = load_whole

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        weight = self.tied_embedding.weight if self.tied_embedding is not None else self.weight
        return kernels.linear(hidden, weight)
