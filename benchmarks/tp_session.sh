#!/usr/bin/env bash
# Tensor-parallel work on a multi-GPU device machine (nvidia-h100-x4, or -x2 without the TP=4 parts), from the
# repo root, nothing carried; each part fits one 10-minute call. Results and logs go to $OUT.
#   bash benchmarks/tp_session.sh micro            # the all-reduce micro-benchmark and the 2-GPU tests (~3 min)
#   bash benchmarks/tp_session.sh 13b [ALL_REDUCE] # tp_gpu.py on llama-13b, TP=1/2(/4), no fp32 reference (~6 min)
#   bash benchmarks/tp_session.sh 70b [ALL_REDUCE] # tp_gpu.py's llama-70b TP=4 run alone (4 GPUs)
#   bash benchmarks/tp_session.sh staged           # the staged decode paths (TIERLLM_DEFER_TP_RESIDUAL,
#                                                  # TIERLLM_FUSE_ROTARY_DECODE, TIERLLM_L2_PREFETCH_MB): their TP GPU
#                                                  # tests, then llama-13b TP=1 and TP=2 all off / staged / with 16
#                                                  # and 32 MiB prefetched (~8 min)
#   PREFETCH_MB=24 bash benchmarks/tp_session.sh 70b-staged  # llama-70b TP=4 (NCCL), staged paths off, then on
# ALL_REDUCE: nccl (default) or symm_mem. The fp32-reference agreement of llama-13b (bf16's own noise floor,
# 82.8% on 2026-11-27) is in tp-1-2-llama-13b-symm-mem-h100x4-partial.json.
set -uo pipefail
part=${1:?part: micro, 13b, 70b, staged or 70b-staged}
all_reduce=${2:-nccl}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpus=$(nvidia-smi -L | wc -l)
case "$part" in
  micro)
    sizes=$([ "$gpus" -ge 4 ] && echo 2,4 || echo 2)
    timeout 150 python3 benchmarks/allreduce_gpu.py --world-sizes "$sizes" 2>&1 | tee "$OUT/allreduce.log" | tail -30
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tee "$OUT/tp_tests.log" | tail -8
    ;;
  13b)
    tp=$([ "$gpus" -ge 4 ] && echo 1,2,4 || echo 1,2)
    python3 benchmarks/tp_gpu.py --tp-sizes "$tp" --presets llama-13b --skip-70b --no-fp32-reference \
        --all-reduce "$all_reduce" 2>&1 | tee "$OUT/tp_gpu_13b_$all_reduce.log" | grep -v "^\s*$" | tail -25
    ;;
  70b)
    python3 benchmarks/tp_gpu.py --tp-sizes 1,4 --presets none --all-reduce "$all_reduce" 2>&1 \
        | tee "$OUT/tp_gpu_70b_$all_reduce.log" | grep -v "^\s*$" | tail -25
    ;;
  staged)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py -k "deferred or prefetch" 2>&1 \
        | tee "$OUT/tp_tests_staged.log" | tail -4
    off=TIERLLM_DEFER_TP_RESIDUAL=0,TIERLLM_FUSE_ROTARY_DECODE=0,TIERLLM_L2_PREFETCH_MB=0
    TIERLLM_DEFER_TP_RESIDUAL=1 TIERLLM_FUSE_ROTARY_DECODE=1 timeout 420 python3 benchmarks/tp_gpu.py --tp-sizes 1,2 \
        --presets llama-13b --skip-70b --no-fp32-reference --variant "off:$off" \
        --variant staged:TIERLLM_L2_PREFETCH_MB=0 --variant pf16:TIERLLM_L2_PREFETCH_MB=16 \
        --variant pf32:TIERLLM_L2_PREFETCH_MB=32 2>&1 | tee "$OUT/tp_gpu_13b_staged.log" | grep -v "^\s*$" | tail -12
    ;;
  70b-staged)
    for on in 0 1; do
      TIERLLM_DEFER_TP_RESIDUAL=$on TIERLLM_FUSE_ROTARY_DECODE=$on TIERLLM_L2_PREFETCH_MB=$((on * ${PREFETCH_MB:-24})) \
          python3 benchmarks/tp_gpu.py --tp-sizes 1,4 --presets none 2>&1 | tee "$OUT/tp_gpu_70b_staged_$on.log" \
          | grep -v "^\s*$" | tail -4
    done
    ;;
  *) echo "unknown part $part: micro, 13b, 70b, staged or 70b-staged" >&2; exit 2 ;;
esac
