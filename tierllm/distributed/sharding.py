"""Which rows of a full checkpoint tensor one tensor-parallel rank holds, and which tp sizes a model allows."""
from __future__ import annotations

from dataclasses import dataclass

_MAX_TP_SIZE_LISTED = 64


@dataclass(frozen=True)
class RowSlice:
    """This rank's part of one dimension of a full checkpoint tensor."""
    full_rows: int          # the dimension in the checkpoint
    start: int              # first row this rank holds
    rows: int               # rows this rank holds


def even_slice(full_rows: int, tp_rank: int, tp_size: int) -> RowSlice:
    """Split evenly: rank r holds rows [r * full/tp, (r + 1) * full/tp)."""
    if full_rows % tp_size:
        raise ValueError(f"{full_rows} rows cannot be split evenly over tp_size={tp_size}")
    rows = full_rows // tp_size
    return RowSlice(full_rows, tp_rank * rows, rows)


def head_slice(num_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> RowSlice:
    """Attention heads: split when tp_size divides num_heads; when there are fewer heads than ranks (GQA's KV
    heads), each rank holds one head, replicated: rank r gets head r * num_heads // tp_size."""
    if num_heads >= tp_size:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} heads cannot be split evenly over tp_size={tp_size}")
        local = num_heads // tp_size
        return RowSlice(num_heads * head_dim, tp_rank * local * head_dim, local * head_dim)
    if tp_size % num_heads:
        raise ValueError(f"{num_heads} KV heads cannot be replicated evenly over tp_size={tp_size}")
    return RowSlice(num_heads * head_dim, (tp_rank * num_heads // tp_size) * head_dim, head_dim)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary is padded up to a multiple of tp_size (zero rows; their logits are cut off), so any tp size
    works for it."""
    return -(-vocab_size // tp_size) * tp_size


def _fits(tp_size: int, split: dict[str, int], replicable: dict[str, int]) -> bool:
    if any(n % tp_size for n in split.values()):
        return False
    return all(n % tp_size == 0 if n >= tp_size else tp_size % n == 0 for n in replicable.values())


def check_tp_size(model_name: str, tp_size: int, split: dict[str, int], replicable: dict[str, int] | None = None):
    """split: counts tp_size must divide (attention heads, MLP width); replicable: counts that may also be smaller
    than tp_size if they divide it (KV heads, replicated). Raises a ValueError listing the tp sizes that work."""
    replicable = replicable or {}
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if _fits(tp_size, split, replicable):
        return
    limit = min(max(list(split.values()) + [1]), _MAX_TP_SIZE_LISTED)
    working = [t for t in range(1, limit + 1) if _fits(t, split, replicable)]
    counts = ", ".join(f"{k}={v}" for k, v in {**split, **replicable}.items())
    raise ValueError(f"tensor parallelism cannot split {model_name} over tp_size={tp_size}: its {counts} must each "
                     f"be divisible by tp_size (KV heads may instead divide it, and are then replicated). "
                     f"tp sizes that work for this model: {', '.join(map(str, working))}")
