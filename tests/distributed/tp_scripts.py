"""Scripts the tensor-parallel tests run in fresh interpreters: `spawn-and-exit` (rank 0 spawns a worker and exits
without closing the engine) and `torchrun` (every rank runs this same file under torchrun)."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from conftest import build_hf_model, random_prompts  # noqa: E402

import tierllm  # noqa: E402


def _tokens(engine, prompts) -> list[list[int]]:
    return [engine.generate(torch.tensor([p]), max_new_tokens=12)[0].tolist() for p in prompts]


def main(mode: str) -> None:
    torch.set_num_threads(1)
    model = build_hf_model("llama_mqa")                       # seeded: the same weights on every rank
    prompts = random_prompts([5, 13], seed=11)
    options = {"show_progress": False, "num_kv_blocks": 64}
    rank = int(os.environ.get("RANK", "0"))
    reference = _tokens(tierllm.init_inference(model, **options), prompts) if rank == 0 else None
    engine = tierllm.init_inference(model, tensor_parallel={"tp_size": 2, "timeout_s": 60}, **options)
    if rank != 0:
        print("RANK1_RETURNED", flush=True)                   # must never run: ranks > 0 exit inside init_inference
        return
    print("TP_MATCH", _tokens(engine, prompts) == reference, flush=True)
    if mode == "spawn-and-exit":
        for process in engine.engine.runner.parallel.workers.processes.values():
            print("WORKER_PID", process.pid, flush=True)
        return                                                # no close(): interpreter exit must shut it down
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
