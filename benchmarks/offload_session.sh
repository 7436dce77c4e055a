#!/usr/bin/env bash
# Offload benchmarks on one GPU of the device machine, from the repo root, with .whl carried:
#   bash benchmarks/offload_session.sh all       # the parts below in one process (over 10 minutes on an H100: more
#                                                # than one device call allows; run cpu and nvme-kv as two calls)
#   bash benchmarks/offload_session.sh cpu       # every layer in pinned CPU memory + DeepSpeed / accelerate peers
#   bash benchmarks/offload_session.sh nvme-kv   # NVMe tier + KV-cache offload at a fixed GPU budget
#   bash benchmarks/offload_session.sh kv        # KV-cache offload alone (about 4 minutes)
#   bash benchmarks/offload_session.sh q70       # llama-70b int4 streamed under 24GiB vs its PCIe-floor throughput
# .whl holds the server/test wheels, deepspeed-0.19.8.tar.gz and the wheels DeepSpeed lacks in the image
# (hjson, msgpack, psutil, ninja, einops, py-cpuinfo, pydantic ...). Results and logs go to $OUT.
set -uo pipefail
part=${1:?part: all, cpu, nvme-kv, kv or q70}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | head -2; df -h /root | tail -1
if [ "$part" = cpu ] || [ "$part" = all ]; then
  mkdir -p /tmp/ds && tar xzf .whl/deepspeed-0.19.8.tar.gz -C /tmp/ds
  (cd /tmp/ds/deepspeed-0.19.8 && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-compile --target /tmp/site . 2>&1 | tail -3)
  python3 -c "import deepspeed, accelerate; print('deepspeed', deepspeed.__version__, 'accelerate', accelerate.__version__)"
fi
if [ "$part" = all ]; then
  python3 -m tierllm.cli bench offload --parts cpu,nvme,kv --out "$OUT/offload-llama-7b.json" 2>&1 \
      | tee "$OUT/offload.log" | grep -v "^\s*$" | tail -40
elif [ "$part" = q70 ]; then     # llama-70b int4, streamed under a 24GiB GPU budget (issue 5)
  python3 -m tierllm.cli bench offload --parts q70 --out "$OUT/offload-int4-llama-70b.json" 2>&1 \
      | tee "$OUT/offload-q70.log" | grep -v "^\s*$" | tail -30
elif [ "$part" = kv ]; then
  python3 -m tierllm.cli bench offload --parts kv --out "$OUT/offload-kv-llama-7b.json" 2>&1 \
      | tee "$OUT/offload-kv.log" | grep -v "^\s*$" | tail -12
elif [ "$part" = cpu ]; then
  python3 -m tierllm.cli bench offload --parts cpu --out "$OUT/offload-cpu-llama-7b.json" 2>&1 | tee "$OUT/offload-cpu.log" \
      | grep -v "^\s*$" | tail -40
else
  python3 -m tierllm.cli bench offload --parts nvme,kv --out "$OUT/offload-nvme-kv-llama-7b.json" 2>&1 \
      | tee "$OUT/offload-nvme-kv.log" | grep -v "^\s*$" | tail -30
fi
