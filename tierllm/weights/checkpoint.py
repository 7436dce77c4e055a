"""Where weights come from: a local HF folder (config.json + safetensors, sharded or not), a GGUF file (through
transformers' GGUF support, converted once into a folder that later loads read: gguf_cache.py), or a transformers
model already in memory. Nothing is downloaded."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tierllm.weights import gguf_cache


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


@dataclass
class Checkpoint:
    config: object                                # transformers PretrainedConfig
    num_tensors: int                              # for the progress bar
    tensors: Iterator[tuple[str, torch.Tensor]]   # (HF name, tensor), each yielded once
    tokenizer_source: tuple[str, dict] | None     # (path, from_pretrained kwargs) or None
    description: str                              # for messages
    generation_config: object | None = None       # transformers GenerationConfig: default EOS / pad ids
    quant_config: object | None = None            # QuantConfig of a folder written by `tierllm quantize` (tensors
    #                                               then carry native names and are already packed)

    def __str__(self) -> str:
        return self.description


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:                  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {path}: {exc}. The file is corrupt or truncated: copy or save it "
                                  "again (e.g. model.save_pretrained(folder)).") from exc


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"checkpoint shards listed in {index.name} are missing from {folder}: {missing}. "
                                  "Copy the complete checkpoint folder.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {others}: re-save with model.save_pretrained(folder) to get safetensors)" if others else ""
        raise CheckpointError(f"no *.safetensors weights in {folder}{hint}")
    return files


def _count_safetensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
            total += sum(1 for k in header if k != "__metadata__")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}. The file is corrupt or truncated: copy or save it "
                                  "again.") from exc
    return total


def _open_folder(folder: Path) -> Checkpoint:
    from transformers import AutoConfig

    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder} has no config.json: pass a Hugging Face checkpoint folder, a .gguf file "
                              "or a transformers model object")
    config = AutoConfig.from_pretrained(str(folder))
    files = _safetensors_files(folder)
    from transformers import GenerationConfig

    has_tokenizer = any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    gen_config = (GenerationConfig.from_pretrained(str(folder)) if (folder / "generation_config.json").exists()
                  else GenerationConfig.from_model_config(config))
    from tierllm.quant.saved import read_quant_config

    return Checkpoint(config, _count_safetensors(files), _iter_safetensors(files),
                      (str(folder), {}) if has_tokenizer else None, str(folder), gen_config, read_quant_config(folder))


def _open_gguf(path: Path) -> Checkpoint:
    """Through transformers' GGUF support, converted once into a folder that later loads read (gguf_cache.py)."""
    from transformers import AutoModelForCausalLM

    folder = gguf_cache.converted_folder(path)
    if folder is not None and folder.is_dir():
        try:
            return replace(_open_folder(folder), description=str(path))
        except (CheckpointError, OSError, ValueError) as error:
            gguf_cache.drop_conversion(folder, error)
    kwargs = {"gguf_file": path.name}
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    except Exception as exc:
        raise CheckpointError(f"cannot load GGUF file {path}: {exc}") from exc
    if folder is not None and gguf_cache.save_conversion(path, folder, hf_model):
        del hf_model
        return replace(_open_folder(folder), description=str(path))
    state = hf_model.state_dict()
    return Checkpoint(hf_model.config, len(state), iter(state.items()), (str(path.parent), kwargs), str(path),
                      hf_model.generation_config)


def open_checkpoint(source) -> Checkpoint:
    """source: path to a folder or .gguf file, or a transformers PreTrainedModel (or an open Checkpoint)."""
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, torch.nn.Module):
        if not hasattr(source, "config"):
            raise CheckpointError("a model object must be a transformers PreTrainedModel (it needs .config)")
        state = source.state_dict()
        return Checkpoint(source.config, len(state), iter(state.items()), None, type(source).__name__,
                          getattr(source, "generation_config", None))
    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist. tierllm never downloads: pass a local folder "
                              "(config.json + *.safetensors), a .gguf file, or a transformers model object")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf file; pass the checkpoint's folder instead")
        return _open_gguf(path)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists() and len(ggufs) == 1:
        return _open_gguf(ggufs[0])
    return _open_folder(path)
