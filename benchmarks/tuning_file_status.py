"""Whether a GEMV tuning file holds the graph tuner's timings for this checkout's kernel sources, and for which GPU
and compiler versions (tierllm/kernels/tuning_cache.py records them beside its entries). Run it before a GPU call
that should take the kept picks: where the sources changed since the file was written, the call times every config
of every GEMV shape and batch bucket again (minutes), and no CPU-side check can tell otherwise, since the entries
are hashes.

    python benchmarks/tuning_file_status.py [.tuning/gemv-tuning.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierllm.kernels import tuning_cache  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Whether FILE (default: where the tuner keeps its timings) holds timings for this checkout's GEMV sources, and
    for which GPU and compilers."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("file", nargs="?", help="a tuning file (default: $TIERLLM_TUNING_CACHE or the cache dir)")
    args = parser.parse_args(argv)
    path = Path(args.file) if args.file else tuning_cache.cache_path()
    if path is None:
        print("the tuning cache is off (TIERLLM_TUNING_CACHE=0)")
        return 0
    ours = tuning_cache.sources_hash()
    versions = tuning_cache.kept_versions(path)
    matching = [v for v in versions if v.get("sources") == ours]
    print(f"tuned GEMV sources here: {ours} ({len(tuning_cache.tuned_sources())} files); {path}: "
          + (f"{len(versions)} recorded code versions" if path.exists() else "no such file"))
    for version in matching:
        print("  timings kept for these sources on {gpu} (triton {triton}, torch {torch}, CUDA {cuda})".format(
            **{key: version.get(key) for key in ("gpu", "triton", "torch", "cuda")}))
    if path.exists() and not versions:
        print("  the file records no code versions (written before they were recorded): cannot tell")
    elif not matching:
        print("  none for these sources: the first use of each GEMV shape and batch bucket times its configs again")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
