"""Strict weight loading: every checkpoint tensor finds its place, every parameter (and every shard of a fused
one) is filled, or the error names what is left over or missing."""
from __future__ import annotations

from tqdm.auto import tqdm

from tierllm.models.base import NativeModel
from tierllm.weights.checkpoint import Checkpoint, CheckpointError


def load_weights(model: NativeModel, checkpoint: Checkpoint, show_progress: bool = True) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    unused: list[str] = []
    bar = tqdm(checkpoint.tensors, total=checkpoint.num_tensors, desc="Loading weights", unit="tensor",
               disable=not show_progress, leave=False)
    for hf_name, tensor in bar:
        if model.is_ignored(hf_name):
            continue
        name, shard_id, transform = model.map_param_name(hf_name)
        param = params.get(name)
        if param is None:
            unused.append(hf_name)
            continue
        if transform == "transpose":
            tensor = tensor.t()
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint tensor {hf_name!r} does not fit parameter {name!r}: {exc}") from exc
        loaded.setdefault(name, set()).add(shard_id)
    if unused:
        raise CheckpointError(f"{len(unused)} checkpoint tensors of {checkpoint.description} are not used by the "
                              f"native {type(model).__name__}: {unused[:8]}{' ...' if len(unused) > 8 else ''}. "
                              "The checkpoint does not match its config.json.")
    missing = []
    for name, param in params.items():
        expected = set(getattr(param, "shard_ids", (None,)))
        absent = expected - loaded.get(name, set())
        if absent:
            missing.append(name if absent == {None} else f"{name} (shards {sorted(map(str, absent))})")
    if missing:
        raise CheckpointError(f"{len(missing)} parameters are missing from {checkpoint.description}: "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete.")
