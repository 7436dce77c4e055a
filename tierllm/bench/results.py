"""Benchmark result files: device, date, versions, measured ceilings, peers and the checks list."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from tierllm.kernels._dispatch import HAS_TRITON


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def _git_commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest() -> str:
    """sha256 (first 16 hex digits) of the tierllm package's Python sources as they ran: it names the code even
    where the checkout's git metadata lags its files (the device machine's copy): compute it at candidate commits
    to find the one a result came from."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def versions() -> dict:
    import transformers

    import tierllm
    out = {"tierllm": tierllm.__version__, "commit": _git_commit(), "source_sha256": source_digest(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    if HAS_TRITON:                                   # the compiler behind every Triton kernel's timing
        import triton
        out["triton"] = triton.__version__
    flags = {k: v for k, v in os.environ.items() if k.startswith("TIERLLM_")}   # staged paths, kernel overrides
    return {**out, "tierllm_env": flags} if flags else out


def check(name: str, value: float, op: str, target: float) -> dict:
    """One acceptance number: op is ">=" or "<=" (DESIGN.md)."""
    if op not in (">=", "<="):
        raise ValueError(f"a check's op is '>=' or '<=', not {op!r}")
    passed = value >= target if op == ">=" else value <= target
    return {"name": name, "value": round(value, 4), "op": op, "target": target, "passed": passed}


def write_result(path: Path, benchmark: str, device: torch.device, ceilings: dict, peers: dict, results: dict,
                 checks: list[dict], settings: dict) -> dict:
    doc = {"benchmark": benchmark, "device": device_name(device),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions(), "settings": settings, "ceilings": ceilings, "peers": peers,
           "results": results, "checks": checks}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def print_checks(checks: list[dict]) -> None:
    width = max((len(c["name"]) for c in checks), default=0)        # a run with nothing to check prints nothing
    for c in checks:
        mark = "PASS" if c["passed"] else "FAIL"
        print(f"  {mark}  {c['name']:<{width}}  {c['value']:>10.3f} {c['op']} {c['target']}")
