"""The LM head in int8 (QuantConfig(lm_head=True)): a QuantLinear over this rank's vocabulary rows, with
ParallelLMHead's all-gather. Its weights are its own even where the model ties the head to the embedding (the
embedding stays dense: its lookups read one row per token, not the whole table)."""
from __future__ import annotations

import torch

from tierllm.config import QuantConfig
from tierllm.layers.embedding import ParallelLMHead, gather_vocab
from tierllm.layers.quant_linear import QuantLinear

HEAD_QUANT = QuantConfig(bits=8)              # per output channel, symmetric, weight-only


class QuantLMHead(QuantLinear):
    """Logits [num_rows, vocab] from final hidden states through int8 weights [vocab / tp, hidden]."""

    def __init__(self, head: ParallelLMHead):
        """An empty int8 head in the place of `head` (same rows, device and vocabulary slice)."""
        weight = head.dense_weight
        num_local, hidden_size = weight.shape
        super().__init__(hidden_size, num_local, False, HEAD_QUANT, weight.dtype, weight.device)
        self.parallel = head.parallel
        self.vocab_size = head.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        return gather_vocab(super().forward(hidden), self.parallel, self.vocab_size)

    def extra_repr(self) -> str:
        return f"hidden={self.in_features}, vocab_rows={self.out_features}, quant={self.quant.name}"
