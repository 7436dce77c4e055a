"""Benchmark model shapes with random weights, built fast: parameters are carved from one random pool
(per-parameter normal_ on a 7B model takes minutes)."""
from __future__ import annotations

import torch

PRESETS = {
    "llama-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama-13b": dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "llama-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    # SmolLM2-1.7B's shape: 32 heads split over 2, 4 or 8 GPUs (the 135M model's 9 heads split over none of them)
    "smollm2-1.7b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=130000.0),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0),
}


def preset_config(name: str):
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


class RandomPool:
    """N(0, 0.02) values that every weight is carved from (chunks at random offsets): per-parameter normal_ on a 7B
    model takes minutes. Drawn on the CPU from `seed`, so every process (tensor-parallel ranks too) gets the same
    values; kept on `device`."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str, seed: int, size: int = 1 << 25):
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(size, generator=self.gen) * 0.02).to(device, dtype)     # [size]

    @torch.no_grad()
    def fill_(self, flat: torch.Tensor, is_norm: bool = False) -> torch.Tensor:
        """Fill a 1-D view in place (norm weights with 1)."""
        if is_norm:
            return flat.fill_(1.0)
        half = self.pool.numel() // 2
        for start in range(0, flat.numel(), half):
            n = min(half, flat.numel() - start)
            offset = int(torch.randint(0, half, (1,), generator=self.gen))
            flat[start:start + n].copy_(self.pool[offset:offset + n])
        return flat

    def tensor(self, shape, is_norm: bool = False) -> torch.Tensor:
        out = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
        self.fill_(out.view(-1), is_norm)
        return out


@torch.no_grad()
def build_preset_hf_model(name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    """A transformers model of the preset's shape with N(0, 0.02) weights (norm weights 1)."""
    from transformers import AutoModelForCausalLM

    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()                                      # to_empty unties shared parameters
    pool = RandomPool(dtype, device, seed)
    for name_, param in model.named_parameters():
        pool.fill_(param.view(-1), is_norm="norm" in name_)
    for module_name, module in list(model.named_modules()):
        if module_name.endswith("rotary_emb"):                 # non-persistent buffers: rebuild for real
            parent = model.get_submodule(module_name.rsplit(".", 1)[0])
            parent.rotary_emb = type(module)(config).to(device)
    return model.eval()


class PresetSource:
    """A preset as a checkpoint source that any process can open by itself: every tensor is generated on the
    opening rank's device from the same seeded pool, so all tensor-parallel ranks (and a TP=1 run) see the same
    weights without building or sending the whole model (a 70B preset fits no single GPU)."""

    def __init__(self, name: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.name, self.dtype, self.seed = name, dtype, seed
        self.config = preset_config(name)

    def __str__(self) -> str:
        return f"preset {self.name}"

    def _shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        return [(name, tuple(p.shape)) for name, p in model.named_parameters()]   # tied weights listed once

    def open_checkpoint(self, device: torch.device):
        from tierllm.weights.checkpoint import Checkpoint

        shapes = self._shapes()
        return Checkpoint(self.config, len(shapes), self._tensors(shapes, torch.device(device)), None, str(self))

    def _tensors(self, shapes, device: torch.device):
        pool = RandomPool(self.dtype, device, self.seed)               # the same values on every rank
        for name, shape in shapes:
            yield name, pool.tensor(shape, is_norm="norm" in name)
