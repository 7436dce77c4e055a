#!/usr/bin/env bash
# Quantization work on one GPU of the device machine, from the repo root, nothing carried; each part fits one
# 10-minute call. Results and logs go to $OUT.
#   bash benchmarks/quant_session.sh tests   # tests/gpu/test_quant_gpu.py in two halves (each config of every kernel
#                                            # compiles and runs: over 300 s in one go on an H100), then the int8
#                                            # and int4 decode chains (PDL) against plain launches
#   bash benchmarks/quant_session.sh probe   # the autotuner's picks and times per llama-7b shape, plus each
#                                            # HALF_DEQUANT GEMM config (about 2 minutes)
#   bash benchmarks/quant_session.sh bench   # quant_gpu.py: bf16 / int8 / int4 decode and prefill (about 5 minutes
#                                            # without the kernel table)
set -uo pipefail
part=${1:?part: tests, probe or bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "$part" in
  tests)
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py -k "weight_only or every_gemm" \
        2>&1 | tee "$OUT/gpu-tests-quant-1.log" | tail -8
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py \
        -k "not weight_only and not every_gemm" 2>&1 | tee "$OUT/gpu-tests-quant-2.log" | tail -8
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py -k chained 2>&1 \
        | tee "$OUT/gpu-tests-quant-chain.log" | tail -4
    ;;
  probe)
    timeout 300 python3 benchmarks/quant_kernel_sweep.py --autotuned-only 2>&1 | tee "$OUT/quant-autotuned.log" \
        | grep -E "best|wrote" | cut -c1-400
    ;;
  bench)
    timeout 560 python3 benchmarks/quant_gpu.py --variants bf16,int8,int4 --no-kernel-table \
        --out "$OUT/quant-llama-7b.json" 2>&1 | tee "$OUT/quant-llama-7b.log" | tail -22
    ;;
  *) echo "unknown part $part: tests, probe or bench" >&2; exit 2 ;;
esac
