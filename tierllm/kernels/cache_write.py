"""Write the step's new keys and values into their slots of the blocked KV cache."""
import torch


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] = block * block_size + offset."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
