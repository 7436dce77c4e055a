"""A script that starts a TP=2 engine at import time, without `if __name__ == "__main__":`. The spawned worker
re-imports it, tries to start its own workers during its bootstrap and dies; rank 0 must say so at once."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import build_hf_model  # noqa: E402

import tierllm  # noqa: E402

tierllm.init_inference(build_hf_model("llama"), tensor_parallel={"tp_size": 2, "timeout_s": 120},
                       show_progress=False, num_kv_blocks=64)
