"""`tierllm plan` on presets (meta-device models: nothing is loaded) and the offload flags of `tierllm generate`."""
from __future__ import annotations

import re

import pytest

from tierllm.cli import main


def _value(text: str, label: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(label))
    return float(re.findall(r"[0-9.]+", line[len(label):])[0])


def test_plan_llama_7b_everything_streams_when_the_kv_cache_needs_the_room(capsys):
    assert main(["plan", "llama-7b", "--gpu-memory", "24GiB", "--max-model-len", "544"]) == 0
    text = capsys.readouterr().out
    assert "32 offloaded decoder layers (cpu)" in text
    assert 12.0 < _value(text, "32 offloaded decoder layers (cpu)") < 12.6        # 32 x 202M bf16 parameters
    assert _value(text, "max batch with KV offload") > 2 * _value(text, "max batch at 544 tokens")


def test_plan_keeps_layers_resident_when_few_requests_need_kv(capsys):
    assert main(["plan", "llama-70b", "--gpu-memory", "40GiB", "--max-model-len", "544", "--max-num-seqs", "8"]) == 0
    text = capsys.readouterr().out
    resident = int(re.search(r"(\d+) resident decoder layers", text).group(1))
    offloaded = int(re.search(r"(\d+) offloaded decoder layers", text).group(1))
    assert resident > 10 and resident + offloaded == 80


def test_plan_budget_below_one_layer_names_the_minimum(capsys):
    assert main(["plan", "llama-70b", "--gpu-memory", "2GiB"]) == 2
    assert re.search(r"error: the GPU budget \(2.00 GiB\) is too small: the minimum is [0-9.]+ GiB",
                     capsys.readouterr().err)


@pytest.mark.slow
def test_generate_cli_streams_smollm2_from_nvme_with_kv_offload(capsys, tmp_path):
    """The README's main job with every offload flag: the answer is the resident run's answer."""
    question = ["What is the capital of France?", "--max-new-tokens", "16", "--max-model-len", "256"]
    assert main(["generate", *question]) == 0
    resident = capsys.readouterr().out
    assert main(["generate", *question, "--offload", "nvme", "--nvme-path", str(tmp_path),
                 "--num-resident-layers", "10", "--kv-offload"]) == 0
    assert capsys.readouterr().out == resident and "Paris" in resident
    assert list(tmp_path.iterdir()) == []                    # the layer files are gone with the engine


def test_plan_predicts_the_decode_step_from_probe_ceilings(capsys, tmp_path):
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text('{"hbm_copy_GBps(read+write)": 3000.0, "h2d_pinned_GBps": 50.0}')
    assert main(["plan", "llama-7b", "--gpu-memory", "24GiB", "--max-model-len", "544", "--ceilings",
                 str(ceilings)]) == 0
    text = capsys.readouterr().out
    offloaded_gib = _value(text, "32 offloaded decoder layers (cpu)")
    # every layer streams: the step is the PCIe time of the offloaded bytes (HBM reads overlap and are faster)
    assert abs(_value(text, "predicted decode step") - offloaded_gib * 2 ** 30 / 50e9 * 1e3) < 1.0
