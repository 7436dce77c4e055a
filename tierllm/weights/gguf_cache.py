"""A GGUF file converted once into a Hugging Face folder (config, generation config, safetensors, tokenizer) that
later loads read directly. transformers parses a GGUF file's metadata for the config, again for the weights and
again for the tokenizer, and dequantizes in numpy: for the embedded SmolLM2-135M that took ~18 of the 23 s of
`tierllm generate` on a 2-core CPU, every run. The folder holds the tensors transformers produced (fp32 for a
quantized GGUF), so a load from it gives the same weights, config and tokenizer.

Where: $TIERLLM_GGUF_CACHE (a folder), by default ~/.cache/tierllm/gguf ($XDG_CACHE_HOME is honoured);
TIERLLM_GGUF_CACHE=0 turns it off. A conversion is found by the GGUF file's path, size and modification time and
the transformers version; a newer one replaces the older conversions of the same path. One that would fill over a
quarter of the free disk space is not kept (transformers dequantizes to fp32: a 70B GGUF would take 280 GB)."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from tierllm.cache_dirs import cache_location

log = logging.getLogger(__name__)

FORMAT = 1                      # bump when what a conversion folder holds changes
MAX_DISK_SHARE = 0.25           # a conversion larger than this share of the free disk space is not kept


def cache_root() -> Path | None:
    return cache_location("TIERLLM_GGUF_CACHE", "gguf")


def _path_prefix(gguf: Path) -> str:
    """The conversions of one GGUF path share this folder-name prefix."""
    return f"{gguf.stem}-{hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]}-"


def converted_folder(gguf: Path) -> Path | None:
    """Where the conversion of this version of `gguf` lives (it may not exist yet); None when the cache is off."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    stat = gguf.stat()
    version = f"{stat.st_size} {stat.st_mtime_ns} {transformers.__version__} {FORMAT}"
    return root / (_path_prefix(gguf) + hashlib.sha256(version.encode()).hexdigest()[:8])


def save_conversion(gguf: Path, folder: Path, hf_model) -> bool:
    """Write `hf_model` (loaded from `gguf`) and the GGUF's tokenizer into `folder`, whole or not at all, and drop
    older conversions of the same path -> whether `folder` now holds it. A failure (disk full, no write access) is
    a warning: the caller goes on with the model it loaded."""
    from transformers import AutoTokenizer

    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _drop_abandoned(folder.parent)
        state = hf_model.state_dict()
        size = sum(t.numel() * t.element_size() for t in state.values())
        free = shutil.disk_usage(folder.parent).free
        if size > free * MAX_DISK_SHARE:
            log.info("%s not converted into %s: its %.1f GB would take over %d%% of the %.1f GB free there", gguf,
                     folder.parent, size / 1e9, 100 * MAX_DISK_SHARE, free / 1e9)
            return False
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
        _save_model(hf_model, state, tmp)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        os.rename(tmp, folder)                          # whole or not at all
    except Exception as error:                          # the load goes on without the cache
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not folder.is_dir():                         # else another process finished the same conversion first
            _warn_once(f"the converted GGUF {gguf.name} was not kept in {folder.parent} ({error}); later loads "
                       "convert it again. Set TIERLLM_GGUF_CACHE to a writable folder, or 0")
            return False
    for old in folder.parent.glob(_path_prefix(gguf) + "*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    log.info("converted %s once into %s; later loads read that folder (TIERLLM_GGUF_CACHE=0: off)", gguf, folder)
    return True


def _save_model(hf_model, state: dict, folder: Path) -> None:
    """config.json, generation_config.json and model.safetensors (`state`: hf_model's state dict), as save_pretrained
    writes them (transformers refuses save_pretrained on a model loaded from a quantized GGUF): a tied weight
    (lm_head = embed_tokens) once."""
    from safetensors.torch import save_file

    tensors, stored = {}, set()
    for name, tensor in state.items():
        if tensor.data_ptr() not in stored:
            stored.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf_model.config.save_pretrained(folder)
    hf_model.generation_config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)         # the GGUF's: the tensors here are dequantized
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _drop_abandoned(root: Path) -> None:
    """Remove conversions that a process left half-written over a day ago (it was killed)."""
    for tmp in root.glob(".converting-*"):
        try:
            if time.time() - tmp.stat().st_mtime > 86400:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def drop_conversion(folder: Path, error: Exception) -> None:
    """A conversion folder that does not load (files removed or damaged by hand): remove it, say so."""
    _warn_once(f"the converted GGUF in {folder} did not load ({error}); converting the GGUF file again")
    shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
