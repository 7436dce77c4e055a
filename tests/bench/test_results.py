"""Result files name the code that produced them: a digest of the package sources next to the git commit."""
import json

import torch

from tierllm.bench import results


def test_result_file_carries_versions_and_a_source_digest(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    monkeypatch.delenv("TIERLLM_EXAMPLE_FLAG", raising=False)
    results.write_result(out, "unit", torch.device("cpu"), {"x": 1.0}, {}, {"y": 2}, [], {"s": 3})
    doc = json.loads(out.read_text())
    assert "TIERLLM_EXAMPLE_FLAG" not in doc["versions"].get("tierllm_env", {})
    from tierllm.kernels._dispatch import HAS_TRITON
    if HAS_TRITON:                                                 # the kernels' compiler is named too
        import triton
        assert doc["versions"]["triton"] == triton.__version__
    monkeypatch.setenv("TIERLLM_EXAMPLE_FLAG", "1")                 # any TIERLLM_* variable is named in the result
    assert results.versions()["tierllm_env"]["TIERLLM_EXAMPLE_FLAG"] == "1"
    digest = doc["versions"]["source_sha256"]
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert digest == results.source_digest()                     # stable for the same sources
    package = tmp_path / "pkg"
    (package / "bench").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(results, "__file__", str(package / "bench" / "results.py"))
    before = results.source_digest()
    (package / "a.py").write_text("x = 2\n")
    assert results.source_digest() != before                     # any source change shows


def test_print_checks_of_a_run_without_checks_prints_nothing(capsys):
    results.print_checks([])                       # e.g. quant_gpu.py --variants bf16: no ratio to check
    assert capsys.readouterr().out == ""
