#!/usr/bin/env bash
# Quantization work on one GPU of the device machine, from the repo root, nothing carried; each part fits one
# 10-minute call. Results and logs go to $OUT.
#   bash benchmarks/quant_session.sh peer-split # int4_peer_kernels.py (torch's tinygemm int4 kernel, cuBLAS bf16 and
#                                            # XHALF per llama-7b linear), then int4_split_k_probe.py (~8 minutes)
#   bash benchmarks/quant_session.sh tests   # the int8 and int4 decode chains (PDL) against plain launches and the
#                                            # PTX nibble unpacking, then tests/gpu/test_quant_gpu.py in two halves
#                                            # (each config of every kernel compiles and runs: the first half took
#                                            # over 220 s on an H100)
#   bash benchmarks/quant_session.sh probe   # the autotuner's picks and times per llama-7b shape, plus each
#                                            # HALF_DEQUANT GEMM config (about 2 minutes)
#   bash benchmarks/quant_session.sh int8    # the int8 one-row loops: their GPU tests, then int8_row_ab.py --grid
#                                            # (general, ROW and ROW + SUM16 configs; about 2 minutes warm)
#   bash benchmarks/quant_session.sh int4sub # int4's one-row loops, INT4_SUB (with and without PREFETCH) against
#                                            # INT4_ROW: the CPU-side kernel tests natively, then
#                                            # benchmarks/int4_sub_grid.py --prefetch (~5 minutes); the tests
#                                            # include int4's graph tuner on the GPU
#   bash benchmarks/quant_session.sh small-batch # benchmarks/small_batch_paths.py: at batch 1-8, the int4 and int8
#                                            # GEMVs against the GEMM (and bf16's GEMV, cuBLAS) per llama-7b shape
#   bash benchmarks/quant_session.sh ncu     # Nsight Compute sections of the bf16 GEMV, int8's SUM16 loop and int4's
#                                            # INT4_ROW and INT4_SUB loops on two llama-7b shapes
#                                            # (benchmarks/gemv_ncu.py), to $OUT/gemv-ncu.txt
#   bash benchmarks/quant_session.sh mma     # the tensor-core int4 GEMV's tests natively (SPLIT_K among them), then
#                                            # w4_mma_grid.py over 4-8 warps, 2-4 groups per warp per iteration and
#                                            # K in 1, 2 or 4 runs per tile (~6 minutes warm)
#   bash benchmarks/quant_session.sh norm-ab # int4's RMSNorm inside its one-row GEMV (TIERLLM_INT4_NORM_INSIDE=1)
#                                            # against the separate norm kernels: the INT4_SUB NORM and decode
#                                            # attention tests natively, then quant_gpu.py bf16,int4 --batch 1 with
#                                            # and without it, each with its batch-1 kernel timeline (~8 minutes with
#                                            # the GEMVs timed afresh; batch 1 alone: one graph bucket to tune)
#   bash benchmarks/quant_session.sh batch1 [VAR [VALUES]] # the prepared-x loops' tests natively (XGLOBAL, PAIRED, XHALF)
#                                            # and the rotary and decode attention ones, then
#                                            # quant_gpu.py bf16,int4 --batch 1 with its batch-1 kernel timelines (~6
#                                            # minutes with the GEMVs timed afresh); VAR (an environment variable,
#                                            # e.g. TIERLLM_STEP_TUNER) [VALUES]: a run with VAR at each value (default
#                                            # "0 1")
#   bash benchmarks/quant_session.sh mma-ncu # the same sections for the tensor-core int4 GEMV (w4_mma_gemv.py) and the
#                                            # CUDA-core one (XHALF) on four llama-7b shapes (benchmarks/w4_mma_ncu.py),
#                                            # then the real-timed graph tuner's test
#   bash benchmarks/quant_session.sh bench [VARIANTS]   # quant_gpu.py, bf16 first (default bf16,int4): decode and
#                                            # prefill. On a fresh machine (cold Triton cache) bf16 took 230-255 s
#                                            # to build and capture, int4 135 s: three variants do not fit one call
#   bash benchmarks/quant_session.sh stream [CONFIGS] # int4_stream_probe.py: the read ceiling per llama-7b int4
#                                            # shape, chained with PDL (register loads, cp.async, TMA; CONFIGS: its
#                                            # --configs)
#   bash benchmarks/quant_session.sh steps [VARIANT [OPTIONS]] # decode_step_times.py: batch-1 decode time against
#                                            # the step count (steady step, once-per-generate cost) and per-step host
#                                            # times (OPTIONS: more of its options, e.g. "--verbose")
#   bash benchmarks/quant_session.sh fused-mlp # int4_fused_mlp_probe.py: the int4 MLP in one kernel against the
#                                            # engine's gate/up -> down chain (the CPU count and cgroup quota first)
#   bash benchmarks/quant_session.sh gemm64  # int4_gemm_m64_grid.py: the int4 GEMM at batch 64 over the tuner's and a
#                                            # wider grid of tiles against cuBLAS bf16, per llama-7b linear
#   bash benchmarks/quant_session.sh wgmma [WARPS] # the int4 wgmma GEMM's GPU tests, then int4_wgmma_probe.py at
#                                            # 64, 32 and 16 rows (~4 minutes; WARPS: its --warps, default 4,8)
#   bash benchmarks/quant_session.sh k-order # x in the wgmma GEMM's k order: its kernels' tests natively (norm,
#                                            # SiLU-and-mul, attention), the GEMM's and the tiny int4 models' GPU
#                                            # tests, then quant_gpu.py bf16,int4 at batch 64 and 32 (~6 minutes with
#                                            # the GEMV picks carried in .tuning)
#   bash benchmarks/quant_session.sh wgmma-ncu # Nsight Compute on that GEMM at 64 rows (benchmarks/int4_wgmma_ncu.py):
#                                            # warp states, scheduler, occupancy, and the stall samples per SASS
#                                            # instruction ($OUT/int4-wgmma-ncu-source.csv)
#   bash benchmarks/quant_session.sh gemm64-ncu # Nsight Compute sections of that GEMM's picks and cuBLAS bf16
#   bash benchmarks/quant_session.sh w4a8    # w4a8_dp4a_probe.py: an int4 GEMV on int8 x (DP4A) against XHALF
#   bash benchmarks/quant_session.sh attention # decode_attention_probe.py: the decode attention's tile, split count
#                                            # and warps at batch 1, 32 layers chained, contexts 128, 576 and 2048
#   bash benchmarks/quant_session.sh epilogue # the XHALF epilogue options' and the bf16/int8 GEMV's fused tests
#                                            # natively, then xhalf_epilogue_probe.py (EARLY_RESIDUAL, STACKED_SUM
#                                            # A/B per llama-7b shape at decode's picks)
#   bash benchmarks/quant_session.sh held [SHAPES [EXTRA]] # HELD's tests natively (int4_held_x.py, ~10 s), then
#                                            # int4_tuner_timings.py: every one-row config of SHAPES (default
#                                            # qkv,gate_up) timed as the graph tuner does, EXTRA: HELD configs added
#                                            # for this run (BLOCK_N:warps:per_sm, comma-separated; ~1 minute a shape)
# The GEMV tuner's timings (kernels/tuning_cache.py) go to .tuning/ and come back in $OUT: copy the file back to
# .tuning/ here and name .tuning in the next call's carry, and that call takes the picks without timing them again.
set -uo pipefail
part=${1:?part: peer-split, fused-mlp, gemm64, gemm64-ncu, wgmma, wgmma-ncu, k-order, tests, attention, epilogue, steps, stream, w4a8, probe, int8, int4sub, small-batch, ncu, mma, norm-ab, batch1, mma-ncu, held or bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TIERLLM_TUNING_CACHE=${TIERLLM_TUNING_CACHE:-$PWD/.tuning/gemv-tuning.json}
trap 'cp "$TIERLLM_TUNING_CACHE" "$OUT/" 2>/dev/null' EXIT
python3 benchmarks/tuning_file_status.py "$TIERLLM_TUNING_CACHE" || true        # kept picks for this code, or minutes
# python3 -c "$LOGGED" SCRIPT ARGS: runs SCRIPT with the GEMV tuner's and the parallel compiler's INFO lines (each
# timed key: configs, compiled specializations, seconds), timestamped in ms
LOGGED='import logging, runpy, sys
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d %(name)s %(message)s")
for name in ("tierllm.kernels.graph_tuning", "tierllm.kernels.parallel_compile"):
    logging.getLogger(name).setLevel(logging.INFO)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "$part" in
  peer-split)
    timeout 200 python3 benchmarks/int4_peer_kernels.py --out "$OUT/int4-peer-kernels-h200.json" 2>&1 \
        | tee "$OUT/int4-peer-kernels.log" | grep -v -i warn | cut -c1-600
    timeout 380 python3 benchmarks/int4_split_k_probe.py --budget-s 300 --out "$OUT/int4-split-k-probe-h200.json" \
        2>&1 | tee "$OUT/int4-split-k-probe.log" | grep -v -i warn | cut -c1-400
    ;;
  tests)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py -k "chained or nibbles" \
        2>&1 | tee "$OUT/gpu-tests-quant-chain.log" | tail -4
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py \
        -k "not weight_only and not every_gemm" 2>&1 | tee "$OUT/gpu-tests-quant-2.log" | tail -8
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py -k "weight_only or every_gemm" \
        2>&1 | tee "$OUT/gpu-tests-quant-1.log" | tail -8
    ;;
  steps)
    timeout 560 python3 benchmarks/decode_step_times.py --variant "${2:-int4}" ${3:+$3} \
        --out "$OUT/decode-step-times-${2:-int4}-h200.json" 2>&1 | tee "$OUT/decode-step-times.log" | tail -12
    ;;
  fused-mlp)
    echo "nproc $(nproc), cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
    timeout 300 python3 -c "$LOGGED" benchmarks/int4_fused_mlp_probe.py --out "$OUT/int4-fused-mlp-probe-h200.json" \
        2>&1 | tee "$OUT/int4-fused-mlp-probe.log" | grep -v -i warn | cut -c1-400
    ;;
  gemm64)
    timeout 560 python3 -c "$LOGGED" benchmarks/int4_gemm_m64_grid.py --out "$OUT/int4-gemm-m64-grid-h200.json" \
        2>&1 | tee "$OUT/int4-gemm-m64-grid.log" | grep -v -i warn | cut -c1-300
    ;;
  wgmma)
    timeout 300 python3 -m pytest -q -x tests/gpu/test_int4_wgmma_gpu.py 2>&1 | tee "$OUT/gpu-tests-int4-wgmma.log" | tail -5
    for rows in 64 32 16; do
      timeout 150 python3 benchmarks/int4_wgmma_probe.py --rows "$rows" --warps "${2:-4,8}" \
          --out "$OUT/int4-wgmma-probe-m$rows.json" \
          2>&1 | grep -v -i warn | grep -v "^           {" | cut -c1-300
    done
    ;;
  k-order)
    timeout 90 python3 -m pytest -q tests/kernels/test_triton_kernels.py -k "k_order or attention or norms" 2>&1 | tail -2
    timeout 150 python3 -m pytest -q -x tests/gpu/test_int4_wgmma_gpu.py tests/gpu/test_quant_gpu.py \
        -k "k_order or tiny or gathered or graph" 2>&1 | tee "$OUT/gpu-tests-k-order.log" | tail -4
    # the first run may time every GEMV config (~3 minutes for int4 without .tuning's picks); the second takes its
    # picks
    for batch in 64 32; do
      timeout $([ "$batch" = 64 ] && echo 300 || echo 150) python3 benchmarks/quant_gpu.py --variants bf16,int4 \
          --no-kernel-table --batch "$batch" --out "$OUT/quant-bf16-int4-b$batch.json" 2>&1 | grep -v -i warn | tail -4
    done
    ;;
  wgmma-ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 400 "$NCU" --clock-control none -k regex:_w4_wgmma --section WarpStateStats --section SourceCounters \
        --section SchedulerStats --section Occupancy --section SpeedOfLight --section LaunchStats \
        -o "$OUT/int4-wgmma" python3 benchmarks/int4_wgmma_ncu.py 2>&1 | grep -v "^==PROF==" | tail -8
    "$NCU" -i "$OUT/int4-wgmma.ncu-rep" > "$OUT/int4-wgmma-ncu.txt" 2>&1
    "$NCU" -i "$OUT/int4-wgmma.ncu-rep" --page source --csv --print-source sass > "$OUT/int4-wgmma-ncu-source.csv" 2>&1
    grep -E "_w4_wgmma|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp|No Eligible|Warp Cycles Per Issued|Executed Ipc|Block Limit|Compute \(SM\) Throughput|Memory Throughput" \
        "$OUT/int4-wgmma-ncu.txt" | cut -c1-150
    ;;
  gemm64-ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 300 "$NCU" --clock-control none -k regex:"_quant_gemm|nvjet" --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        --section ComputeWorkloadAnalysis python3 benchmarks/int4_gemm_m64_grid.py --ncu > "$OUT/int4-gemm-m64-ncu.txt" 2>&1
    grep -E "rel err|_quant_gemm|nvjet|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp|No Eligible|Warp Cycles Per Issued|L2 Hit|Mem Busy|Max Bandwidth|Shared Memory Configuration Size|Block Limit|stalled|Executed Ipc|SM Busy" \
        "$OUT/int4-gemm-m64-ncu.txt" | cut -c1-150
    ;;
  w4a8)
    timeout 400 python3 benchmarks/w4a8_dp4a_probe.py --out "$OUT/w4a8-dp4a-probe-h200.json" 2>&1 \
        | tee "$OUT/w4a8-dp4a-probe.log" | tail -40
    ;;
  attention)
    timeout 300 python3 benchmarks/decode_attention_probe.py --out "$OUT/decode-attention-probe-h200.json" 2>&1 \
        | tee "$OUT/decode-attention-probe.log" | grep -v -i warn | cut -c1-400
    ;;
  epilogue)
    # (a cold H200 ran 32 of the bf16 and int8 GEMV tests in 140 s: each autotuned config compiles)
    timeout 200 python3 -m pytest -v -p no:cacheprovider tests/kernels/test_quant_kernels.py \
        tests/kernels/test_triton_kernels.py -k "epilogue_forms or prepared_x or w8_gemv_one_row or test_gemv_fused" \
        2>&1 | tee "$OUT/gpu-tests-epilogue.log" | grep -E "FAILED|ERROR|passed|failed" | tail -6
    timeout 300 python3 benchmarks/xhalf_epilogue_probe.py --out "$OUT/xhalf-epilogue-probe-h200.json" 2>&1 \
        | tee "$OUT/xhalf-epilogue-probe.log" | grep -v -i warn | cut -c1-900
    ;;
  held)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py -k "held" 2>&1 \
        | tee "$OUT/gpu-tests-held.log" | tail -3
    timeout 420 python3 benchmarks/int4_tuner_timings.py --shapes "${2:-qkv,gate_up}" ${3:+--held-extra "$3"} \
        --out "$OUT/int4-tuner-timings-h200.json" 2>&1 | tee "$OUT/int4-tuner-timings.log" | grep -v -i warn | cut -c1-600
    ;;
  stream)
    timeout 300 python3 benchmarks/int4_stream_probe.py ${2:+--configs "$2"} --out "$OUT/int4-stream-probe-h200.json" 2>&1 \
        | tee "$OUT/int4-stream-probe.log" | tail -50
    ;;
  probe)
    timeout 300 python3 benchmarks/quant_kernel_sweep.py --autotuned-only 2>&1 | tee "$OUT/quant-autotuned.log" \
        | grep -E "best|wrote" | cut -c1-400
    ;;
  int8)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py \
        -k "subnormal or one_row_loop" 2>&1 | tee "$OUT/gpu-tests-int8-row.log" | tail -3
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_gpu.py -k "every_int8" 2>&1 \
        | tee -a "$OUT/gpu-tests-int8-row.log" | tail -3
    timeout 330 python3 benchmarks/int8_row_ab.py --grid 2>&1 | tee "$OUT/int8-row-grid.log" | grep -v -i warn \
        | cut -c1-600
    ;;
  int4sub)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py \
        -k "nibbles_as_subnormals or subnormal_loop or int4_sub or w4_gemv_graph_tuned" 2>&1 \
        | tee "$OUT/gpu-tests-int4-sub.log" | tail -3
    timeout 480 python3 benchmarks/int4_sub_grid.py --prefetch 2>&1 | tee "$OUT/int4-sub-grid.log" | grep -v -i warn \
        | cut -c1-600
    ;;
  small-batch)
    timeout 420 python3 benchmarks/small_batch_paths.py 2>&1 | tee "$OUT/small-batch-paths.log" | grep -v -i warn
    ;;
  ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 400 "$NCU" --clock-control none -k regex:_gemv_body --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/gemv_ncu.py > "$OUT/gemv-ncu.txt" 2>&1
    grep -E "rel err|_gemv_body|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issue Slots|Registers Per" \
        "$OUT/gemv-ncu.txt" | cut -c1-160
    ;;
  mma)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_w4_mma_gemv.py 2>&1 \
        | tee "$OUT/gpu-tests-w4-mma.log" | tail -3
    timeout 420 python3 benchmarks/w4_mma_grid.py --warps 4,8 --unroll 2,4 --split 1,2,4 2>&1 \
        | tee "$OUT/w4-mma-grid.log" | grep -v -i warn | cut -c1-700
    ;;
  norm-ab)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py \
        tests/kernels/test_triton_kernels.py tests/kernels/test_tuning_cache.py \
        -k "norm_prologue or subnormal_loop or decode_attention or code_hash" 2>&1 \
        | tee "$OUT/gpu-tests-int4-norm-attention.log" | tail -3
    for inside in 1 0; do
      TIERLLM_INT4_NORM_INSIDE=$inside timeout $((inside ? 280 : 200)) python3 benchmarks/quant_gpu.py \
          --variants bf16,int4 --batch 1 --no-kernel-table --out "$OUT/quant-int4-norm-inside-$inside.json" 2>&1 \
          | grep -v -i warn | tail -5
      mkdir -p "$OUT/timelines-norm-inside-$inside" && mv "$OUT"/timeline-*.json "$OUT/timelines-norm-inside-$inside/"
    done
    ;;
  batch1)
    # (a selection that compiles in time on a cold machine; `mma` runs the tensor-core GEMV's tests, whose cold
    # compiles alone took over 200 s on an H200)
    # (the prepared-x tests took 16 s on a cold H200; the bench 359 s with every int4 GEMV timed afresh)
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py \
        -k "prepared_x" 2>&1 | tee "$OUT/gpu-tests-int4-batch1.log" | tail -3
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
        -k "rotary or decode_attention" 2>&1 | tee -a "$OUT/gpu-tests-int4-batch1.log" | tail -3
    if [ -n "${2:-}" ]; then                  # runs with the environment variable $2 at each of $3 (default 0 1)
      run=0
      for value in ${3:-0 1}; do
        run=$((run + 1))                      # (the first run may time the GEMVs afresh)
        env "$2=$value" timeout $((run > 1 ? 200 : 360)) python3 benchmarks/quant_gpu.py --variants bf16,int4 \
            --batch 1 --no-kernel-table --out "$OUT/quant-int4-batch1-$2-$value-run$run.json" 2>&1 \
            | grep -v -i warn | tail -6
        mkdir -p "$OUT/timelines-run$run" && mv "$OUT"/timeline-*.json "$OUT/timelines-run$run/"
      done
    else
      timeout 480 python3 benchmarks/quant_gpu.py --variants bf16,int4 --batch 1 --no-kernel-table \
          --out "$OUT/quant-int4-batch1.json" 2>&1 | grep -v -i warn | tail -8
    fi
    ;;
  mma-ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 280 "$NCU" --clock-control none -k regex:w4_ --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 benchmarks/w4_mma_ncu.py > "$OUT/w4-mma-ncu.txt" 2>&1
    grep -E "rel err|w4_|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp|No Eligible|Warp Cycles Per Issued|L2 Hit|Mem Busy|Max Bandwidth|One or More|L1/TEX Cache Throughput|stalled" \
        "$OUT/w4-mma-ncu.txt" | cut -c1-150
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py -k "tuned_on_gpu" 2>&1 \
        | tee "$OUT/gpu-tests-int4-tuned.log" | tail -3
    ;;
  bench)
    timeout 580 python3 -c "$LOGGED" benchmarks/quant_gpu.py --variants "${2:-bf16,int4}" --no-kernel-table \
        --out "$OUT/quant-llama-7b.json" 2>&1 | tee "$OUT/quant-llama-7b.log" | tail -22
    ;;
  *) echo "unknown part $part: peer-split, fused-mlp, gemm64, wgmma, wgmma-ncu, k-order, gemm64-ncu, tests, attention, epilogue, steps, stream, w4a8, probe, int8, int4sub, small-batch, ncu, mma, norm-ab, batch1, mma-ncu, held or bench" >&2; exit 2 ;;
esac
