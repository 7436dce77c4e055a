"""A compile worker for parallel_compile.py: `python -m tierllm.kernels.compile_worker` reads one job per line on
stdin (base64 of a pickled parallel_compile.CompileJob), compiles it with triton.compile into Triton's on-disk
cache (TRITON_CACHE_DIR, as its parent passed it), and answers one JSON line per job on stdout: {"ok": true} or
{"ok": false, "error": "..."}. It needs no GPU: the job names its target. It exits when stdin closes."""
from __future__ import annotations

import base64
import importlib
import json
import pickle
import sys


def find_kernel(module_name: str, qualname: str, cache_key: str):
    """The JITFunction of `module_name` (a module attribute, or the function an autotuner wraps) whose Python
    function is `qualname` and whose source hash is `cache_key`: the one the parent launched."""
    from triton.runtime.jit import JITFunction

    module = importlib.import_module(module_name)
    for value in vars(module).values():
        for candidate in (value, getattr(value, "fn", None)):
            if (isinstance(candidate, JITFunction) and candidate.fn.__qualname__ == qualname
                    and candidate.cache_key == cache_key):
                return candidate
    raise LookupError(f"no Triton kernel {module_name}.{qualname} with this source hash")


def compile_job(job) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel = find_kernel(job.module, job.qualname, job.cache_key)
    target = GPUTarget(**job.target)
    # as JITFunction.preload parses them, so that the options (and the cache key) are the launch's own
    options = make_backend(target).parse_options(job.options)
    triton.compile(ASTSource(kernel, job.signature, job.constants, job.attrs), target=target,
                   options=options.__dict__)


def main() -> int:
    answers = sys.stdout
    sys.stdout = sys.stderr                     # nothing but answers on the answer channel
    for line in sys.stdin:
        try:
            compile_job(pickle.loads(base64.b64decode(line)))
            answer = {"ok": True}
        except Exception as error:              # a config the compiler refuses: the parent compiles it and skips it
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
