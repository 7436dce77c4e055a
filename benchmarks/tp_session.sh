#!/usr/bin/env bash
# Tensor-parallel work on a multi-GPU device machine (nvidia-h100-x4, or -x2 without the TP=4 parts), from the
# repo root, nothing carried; one call (about 8 minutes on 4 H100s). Results and logs go to $OUT.
#   bash benchmarks/tp_session.sh symm_mem   # the all-reduce micro-benchmark, the 2-GPU tests, then tp_gpu.py
#                                            # (llama-13b TP=1/2 and llama-70b TP=4) with the one-shot all-reduce
#   bash benchmarks/tp_session.sh nccl       # the same with NCCL's all-reduce (tp_gpu.py's default)
set -uo pipefail
all_reduce=${1:?all_reduce: symm_mem or nccl}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpus=$(nvidia-smi -L | wc -l)
sizes=$([ "$gpus" -ge 4 ] && echo 2,4 || echo 2)
timeout 150 python3 benchmarks/allreduce_gpu.py --world-sizes "$sizes" 2>&1 | tee "$OUT/allreduce.log" | tail -30
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tee "$OUT/tp_tests.log" | tail -8
tp=$([ "$gpus" -ge 4 ] && echo 1,2,4 || echo 1,2)
python3 benchmarks/tp_gpu.py --tp-sizes "$tp" --presets llama-13b --all-reduce "$all_reduce" 2>&1 \
    | tee "$OUT/tp_gpu.log" | grep -v "^\s*$" | tail -25
