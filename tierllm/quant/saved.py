"""Quantized checkpoints as written by `tierllm quantize`: a loadable model folder holding config.json (+
generation config and tokenizer files), model.safetensors with the native model's tensors under their native
names (packed weights as in formats.py), and quant_config.json. Loading one fills empty QuantLinear shells
strictly and never quantizes again."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tierllm.config import QuantConfig
from tierllm.layers.linear import load_whole
from tierllm.quant.quantize import convert_to_quant_shells
from tierllm.weights.checkpoint import Checkpoint, CheckpointError

QUANT_CONFIG_FILE = "quant_config.json"
FORMAT = "tierllm-native"                      # tensor names are the native model's, not HF's


def read_quant_config(folder: Path) -> QuantConfig | None:
    """The QuantConfig of a folder written by `tierllm quantize`, or None for an ordinary checkpoint."""
    path = Path(folder) / QUANT_CONFIG_FILE
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise CheckpointError(f"{path} has format {doc.get('format')!r}; tierllm reads only {FORMAT!r} "
                                  "folders written by `tierllm quantize`")
        return QuantConfig(**doc["quant"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} is not a valid quantization config ({exc}); quantize the model again "
                              "with `tierllm quantize`") from exc


def save_quantized(model: torch.nn.Module, quant: QuantConfig, checkpoint: Checkpoint, tokenizer, dst: Path) -> Path:
    """Write `model` (already quantized) as a folder that build_engine / init_inference load directly."""
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().contiguous().cpu() for name, p in model.named_parameters()}   # tied: stored once
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": FORMAT})
    checkpoint.config.save_pretrained(str(dst))
    if checkpoint.generation_config is not None:
        checkpoint.generation_config.save_pretrained(str(dst))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(dst))
    (dst / QUANT_CONFIG_FILE).write_text(json.dumps({"format": FORMAT, "quant": quant.as_dict()}, indent=1) + "\n")
    return dst


def load_native_weights(model: torch.nn.Module, checkpoint: Checkpoint, show_progress: bool = True) -> None:
    """Strict: every stored tensor has a parameter of the same name, shape and (integer) dtype; every
    parameter is filled exactly once."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unused: list[str] = []
    bar = tqdm(checkpoint.tensors, total=checkpoint.num_tensors, desc="Loading quantized weights", unit="tensor",
               disable=not show_progress, leave=False)
    for name, tensor in bar:
        param = params.get(name)
        if param is None:
            unused.append(name)
            continue
        if name in filled:
            raise CheckpointError(f"tensor {name!r} appears twice in {checkpoint.description}")
        if param.is_floating_point() != tensor.is_floating_point():
            raise CheckpointError(f"tensor {name!r} of {checkpoint.description} is {tensor.dtype}, the model "
                                  f"expects {param.dtype}: the folder was quantized with another config")
        try:
            load_whole(param, tensor)
        except ValueError as exc:
            raise CheckpointError(f"tensor {name!r} does not fit the model: {exc}. The folder was quantized from "
                                  "another model or with another config.") from exc
        filled.add(name)
    if unused:
        raise CheckpointError(f"{len(unused)} tensors of {checkpoint.description} are not used by the quantized "
                              f"{type(model).__name__}: {unused[:8]}{' ...' if len(unused) > 8 else ''}. "
                              "The folder does not match its config.json or quant_config.json.")
    missing = sorted(set(params) - filled)
    if missing:
        raise CheckpointError(f"{len(missing)} tensors are missing from {checkpoint.description}: {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}. The quantized folder is incomplete: write it "
                              "again with `tierllm quantize`.")


def load_prequantized(model: torch.nn.Module, checkpoint: Checkpoint, quant=None, show_progress: bool = True) -> None:
    """Fill a freshly built native model from an already quantized checkpoint: its decoder linears become empty
    QuantLinear shells (build the model on the CPU, where the dense weights they replace are only reserved,
    never written), then the stored tensors fill every shell. `quant`, if given, must match the stored config."""
    stored = checkpoint.quant_config
    if quant is not None and QuantConfig.from_any(quant) != stored:
        raise ValueError(f"{checkpoint.description} is already quantized as {stored.name} ({stored.as_dict()}); "
                         f"drop quant= to load it as it is, or quantize the original model to "
                         f"{QuantConfig.from_any(quant).name}")
    convert_to_quant_shells(model, stored)
    load_native_weights(model, checkpoint, show_progress)


def quantize_checkpoint(source, dst: Path, quant: QuantConfig, dtype: torch.dtype, device: torch.device,
                        show_progress: bool = True, calibration_text: str | None = None) -> Path:
    """`tierllm quantize`: load `source` (HF folder, .gguf, model object), quantize its decoder linears (and its
    LM head where quant.lm_head), and write a folder that loads back quantized. Non-quantized tensors (embedding,
    norms, a dense LM head) are kept in `dtype`.
    calibration_text: GPTQ calibrates on this text (tokenized, cut into sequences) instead of sequences sampled
    from the model."""
    from tierllm.api import _load_tokenizer
    from tierllm.models.registry import resolve_model_class
    from tierllm.quant.quantize import quantize_model
    from tierllm.weights.checkpoint import open_checkpoint
    from tierllm.weights.loader import load_weights

    checkpoint = open_checkpoint(source)
    if checkpoint.quant_config is not None:
        raise ValueError(f"{checkpoint.description} is already quantized ({checkpoint.quant_config.name}); "
                         "quantize the original model instead")
    config = checkpoint.config
    model = resolve_model_class(config)(config, config.max_position_embeddings, dtype, device)
    load_weights(model, checkpoint, show_progress)
    tokenizer = _load_tokenizer(checkpoint.tokenizer_source)
    calibration = None
    if calibration_text is not None:
        from tierllm.quant.gptq import calibration_from_ids
        if tokenizer is None:
            raise ValueError(f"{checkpoint.description} has no tokenizer to read the calibration text with")
        calibration = calibration_from_ids(tokenizer.encode(calibration_text))
    quantize_model(model, quant, show_progress, calibration)
    return save_quantized(model, quant, checkpoint, tokenizer, dst)
