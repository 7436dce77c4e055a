"""The LM head in int8 (QuantConfig(lm_head=True)): a QuantLinear over this rank's vocabulary rows, with
ParallelLMHead's all-gather. Its weights are its own even where the model ties the head to the embedding (the
embedding stays dense: its lookups read one row per token, not the whole table)."""
from __future__ import annotations

import torch

from tierllm.config import QuantConfig
from tierllm.distributed.comm import all_gather_last_dim
from tierllm.layers.embedding import ParallelLMHead
from tierllm.layers.quant_linear import QuantLinear

HEAD_QUANT = QuantConfig(bits=8)              # per output channel, symmetric, weight-only


def dense_head_weight(head: ParallelLMHead) -> torch.Tensor:
    """[vocab / tp, hidden]: the head's own weight, or the tied embedding's."""
    return head.tied_embedding.weight if head.tied_embedding is not None else head.weight


class QuantLMHead(QuantLinear):
    """Logits [num_rows, vocab] from final hidden states through int8 weights [vocab / tp, hidden]."""

    def __init__(self, head: ParallelLMHead):
        """An empty int8 head in the place of `head` (same rows, device and vocabulary slice)."""
        weight = dense_head_weight(head)
        num_local, hidden_size = weight.shape
        super().__init__(hidden_size, num_local, False, HEAD_QUANT, weight.dtype, weight.device)
        self.parallel = head.parallel
        self.vocab_size = head.vocab_size
        self.vocab_start = head.vocab_start

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> [num_rows, vocab]
        logits = super().forward(hidden)                                            # [num_rows, vocab / tp]
        if self.parallel.tp_size == 1:
            return logits
        return all_gather_last_dim(logits, self.parallel)[:, :self.vocab_size]      # [num_rows, vocab]

    def extra_repr(self) -> str:
        return f"hidden={self.in_features}, vocab_rows={self.out_features}, quant={self.quant.name}"
