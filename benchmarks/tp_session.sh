#!/usr/bin/env bash
# Tensor-parallel work on a multi-GPU device machine (nvidia-h100-x4, or -x2 without the TP=4 parts), from the
# repo root, nothing carried; each part fits one 10-minute call. Results and logs go to $OUT.
#   bash benchmarks/tp_session.sh micro            # the all-reduce micro-benchmark and the 2-GPU tests (~8 min on a fresh machine)
#   bash benchmarks/tp_session.sh 13b [ALL_REDUCE] # tp_gpu.py on llama-13b, TP=1/2(/4), no fp32 reference (~6 min)
#   bash benchmarks/tp_session.sh 70b [ALL_REDUCE] # tp_gpu.py's llama-70b TP=4 run alone (4 GPUs)
#   bash benchmarks/tp_session.sh fused-tests      # the fused GEMV all-reduce: kernel tests on one GPU, then on 2
#                                                  # (and 4) ranks, the engine's tokens and a killed worker (~4 min;
#                                                  # FUSED_TESTS="and not killed" leaves the last out)
#   bash benchmarks/tp_session.sh fused-ab         # llama-13b TP=1, then TP=2 with the fused all-reduce and
#                                                  # NCCL's (an A/B on one machine, no fp32 reference); with 4 GPUs
#                                                  # the same at TP=4 in a second process, then llama-70b TP=4 fused
#                                                  # and NCCL (~10 min)
#   bash benchmarks/tp_session.sh pdl-ab           # fused_ab.py: llama-13b TP=1, then TP=2 with programmatic dependent
#                                                  # launch on and off, one process each (~6 min on a fresh machine)
#   bash benchmarks/tp_session.sh chain-ab         # fused_ab.py: llama-13b TP=1, then TP=2 with this checkout (twice)
#                                                  # and with the tierllm unpacked in ab_base/ (an older commit's:
#                                                  # `git archive COMMIT tierllm | tar -x -C ab_base`, not committed)
#   bash benchmarks/tp_session.sh base-ab          # fused_ab.py: llama-13b TP=1 and TP=2 with this checkout, then both
#                                                  # with ab_base/'s tierllm (as chain-ab); ratios to each one's TP=1
#   bash benchmarks/tp_session.sh tuner-ab         # fused_ab.py: llama-13b TP=1 and TP=2 with the GEMVs tuned in CUDA
#                                                  # graphs (TIERLLM_GEMV_TUNER=graph), then both with Triton's tuner
#   bash benchmarks/tp_session.sh sweeps           # decode_gemv_sweep.py at TP=2: the QKV GEMV on GPU 0 and the gate/up
#                                                  # GEMV on GPU 1 at once, both tuners' picks among them (~5 min)
#   bash benchmarks/tp_session.sh gate-up-sweeps   # decode_gemv_sweep.py --linear gate_up at TP=1 on GPU 0 and TP=2 on
#                                                  # GPU 1 at once (a new GPU kind: do the tuners' lists hold?)
#   bash benchmarks/tp_session.sh survey         # a new GPU kind: fused_ab.py (llama-13b TP=1 and TP=2, timelines and
#                                                  # tuned configs) on GPUs 0-1; with 4 GPUs the gate/up and QKV GEMV
#                                                  # sweeps (or SWEEPS="down ...") at TP=1 on GPU 2 and TP=2 on GPU 3
#                                                  # meanwhile (~8 min);
#                                                  # everything in $OUT/survey.tgz
#   bash benchmarks/tp_session.sh step-ab        # fused_ab.py: llama-13b TP=1, then TP=2 with Triton's picks and with
#                                                  # decode-step tuning (TIERLLM_STEP_TUNER=1); with 4 GPUs TP=1 with it
#                                                  # on GPU 2 meanwhile, else after (~8 min with 4 GPUs);
#                                                  # everything in $OUT/step_ab.tgz
#   bash benchmarks/tp_session.sh prefetch-ab [TP] # the L2 prefetch's GPU tests, then fused_ab.py: llama-13b at TP (2 by
#                                                  # default, or 1) without and with TIERLLM_L2_PREFETCH=1 (o_proj's
#                                                  # weight prefetched during the attention), no TP=1 reference at
#                                                  # TP=2: run both parts (~5 minutes each on a fresh machine)
#   bash benchmarks/tp_session.sh invariant        # invariant mode: its GPU tests, then agreement on smollm2-1.7b
#                                                  # and llama-13b at TP=1/2(/4), no speed runs (~8 min)
# Each engine process may take 400 s: on a fresh machine the first llama-13b engine compiles and tunes every Triton
# kernel (TP=1 ran past 250 s on 2 H200s, 2026-11-29); later ones find the compiled kernels on disk.
# ALL_REDUCE: auto (default: the engine's own, fused on GPUs), nccl, symm_mem or fused. The fp32-reference
# agreement of llama-13b (bf16's own noise floor, 82.8% on 2026-11-27) is in
# tp-1-2-llama-13b-symm-mem-h100x4-partial.json.
set -uo pipefail
part=${1:?part: micro, 13b, 70b, fused-tests, fused-ab, pdl-ab, chain-ab, base-ab, tuner-ab, sweeps, gate-up-sweeps,
  survey, step-ab, prefetch-ab or invariant}
all_reduce=${2:-auto}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpus=$(nvidia-smi -L | wc -l)

two_sweeps() {   # LINEAR TP on GPU 0 and LINEAR TP on GPU 1 at once (decode_gemv_sweep.py)
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/decode_gemv_sweep.py --linear "$1" --tp "$2" \
      > "$OUT/sweep_$1_tp$2.log" 2>&1 &
  local first=$!
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/decode_gemv_sweep.py --linear "$3" --tp "$4" \
      > "$OUT/sweep_$3_tp$4.log" 2>&1
  wait "$first"
  tail -8 "$OUT/sweep_$1_tp$2.log" "$OUT/sweep_$3_tp$4.log"
}
case "$part" in
  micro)
    sizes=$([ "$gpus" -ge 4 ] && echo 2,4 || echo 2)
    timeout 150 python3 benchmarks/allreduce_gpu.py --world-sizes "$sizes" 2>&1 | tee "$OUT/allreduce.log" | tail -30
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tee "$OUT/tp_tests.log" | tail -8
    ;;
  13b)
    # one process per TP size: a process sets symmetric memory (fused, symm_mem) up for its first group only
    for n in 2 $([ "$gpus" -ge 4 ] && echo 4); do
      python3 benchmarks/tp_gpu.py --tp-sizes "1,$n" --presets llama-13b --skip-70b --no-fp32-reference \
          --all-reduce "$all_reduce" 2>&1 | tee "$OUT/tp_gpu_13b_${all_reduce}_tp$n.log" | grep -v "^\s*$" | tail -12
    done
    ;;
  70b)
    python3 benchmarks/tp_gpu.py --tp-sizes 1,4 --presets none --all-reduce "$all_reduce" 2>&1 \
        | tee "$OUT/tp_gpu_70b_$all_reduce.log" | grep -v "^\s*$" | tail -25
    ;;
  fused-tests)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv_all_reduce.py 2>&1 \
        | tee "$OUT/fused_kernel_tests.log" | tail -8
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py -k "fused ${FUSED_TESTS:-}" 2>&1 \
        | tee "$OUT/fused_tp_tests.log" | tail -30
    ;;
  fused-ab)
    for n in 2 $([ "$gpus" -ge 4 ] && echo 4); do                   # one process per TP size, as above
      python3 benchmarks/tp_gpu.py --tp-sizes "1,$n" --presets llama-13b --skip-70b --no-fp32-reference \
          --variant fused:all_reduce=fused --variant nccl:all_reduce=nccl 2>&1 \
          | tee "$OUT/tp_gpu_13b_fused_ab_tp$n.log" | grep -v "^\s*$" | tail -8
    done
    if [ "$gpus" -ge 4 ]; then
      for kind in fused nccl; do
        python3 benchmarks/tp_gpu.py --tp-sizes 1,4 --presets none --all-reduce $kind 2>&1 \
            | tee "$OUT/tp_gpu_70b_$kind.log" | grep -v "^\s*$" | tail -6
      done
    fi
    ;;
  pdl-ab)
    python3 benchmarks/fused_ab.py --tp 2 --variant pdl: --variant nopdl:TIERLLM_PDL=0 --no-reverse 2>"$OUT/pdl_ab.err" \
        | tee "$OUT/pdl_ab.log"
    ;;
  chain-ab)
    python3 benchmarks/fused_ab.py --tp 2 --variant new: --variant base:ROOT=ab_base --variant new-again: \
        --no-reverse --timeout 400 2>"$OUT/chain_ab.err" | tee "$OUT/chain_ab.log"
    ;;
  base-ab)
    python3 benchmarks/fused_ab.py --tp 2 --variant new: --variant base:ROOT=ab_base --no-reverse --timeout 400 \
        2>"$OUT/base_ab.err" | tee "$OUT/base_ab.log"
    python3 benchmarks/fused_ab.py --tp 1 --no-tp1 --variant base:ROOT=ab_base --no-reverse --timeout 400 \
        2>>"$OUT/base_ab.err" | tee -a "$OUT/base_ab.log"
    ;;
  tuner-ab)
    TIERLLM_GEMV_TUNER=graph python3 benchmarks/fused_ab.py --tp 2 --variant graph: \
        --variant triton:TIERLLM_GEMV_TUNER=triton --no-reverse --timeout 400 2>"$OUT/tuner_ab.err" \
        | tee "$OUT/tuner_ab.log"
    python3 benchmarks/fused_ab.py --tp 1 --no-tp1 --variant triton:TIERLLM_GEMV_TUNER=triton --no-reverse \
        --timeout 400 2>>"$OUT/tuner_ab.err" | tee -a "$OUT/tuner_ab.log"
    ;;
  sweeps)
    two_sweeps qkv 2 gate_up 2
    ;;
  gate-up-sweeps)
    two_sweeps gate_up 1 gate_up 2
    ;;
  survey)
    mkdir -p /tmp/survey
    if [ "$gpus" -ge 4 ]; then
      for tp in 1 2; do
        ( for linear in ${SWEEPS:-gate_up qkv}; do
            CUDA_VISIBLE_DEVICES=$((tp + 1)) OUT=/tmp/survey timeout 240 python3 benchmarks/decode_gemv_sweep.py \
                --linear $linear --tp $tp > /tmp/survey/sweep_${linear}_tp$tp.log 2>&1
          done ) &
      done
    fi
    CUDA_VISIBLE_DEVICES=0,1 OUT=/tmp/survey timeout 520 python3 benchmarks/fused_ab.py --tp 2 --variant new: \
        --no-reverse --timeout 400 2>/tmp/survey/fused_ab.err | tee /tmp/survey/fused_ab.log
    wait
    tail -4 /tmp/survey/sweep_*.log
    python3 benchmarks/timeline_segments.py /tmp/survey/timeline-*.json
    tar -czf "$OUT/survey.tgz" -C /tmp survey
    ;;
  step-ab)
    dir=/tmp/step_ab
    mkdir -p $dir/tp1
    step_tp1() {
      OUT=$dir/tp1 python3 benchmarks/fused_ab.py --tp 1 --no-tp1 --variant step:TIERLLM_STEP_TUNER=1 --no-reverse \
          --timeout 400 > $dir/step_ab_tp1.log 2>&1
    }
    if [ "$gpus" -ge 4 ]; then CUDA_VISIBLE_DEVICES=2 step_tp1 & fi
    CUDA_VISIBLE_DEVICES=0,1 OUT=$dir python3 benchmarks/fused_ab.py --tp 2 --variant triton: \
        --variant step:TIERLLM_STEP_TUNER=1 --no-reverse --timeout 400 2>$dir/step_ab.err | tee $dir/step_ab.log
    wait
    [ "$gpus" -ge 4 ] || CUDA_VISIBLE_DEVICES=0 step_tp1
    cat $dir/step_ab_tp1.log
    python3 benchmarks/timeline_segments.py $dir/timeline-*.json $dir/tp1/timeline-*.json
    tar -czf "$OUT/step_ab.tgz" -C /tmp step_ab
    ;;
  prefetch-ab)
    tp=${2:-2}
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py -k "l2_prefetch" 2>&1 \
        | tee "$OUT/l2_prefetch_tests.log" | tail -3
    python3 benchmarks/fused_ab.py --tp "$tp" --no-tp1 --variant base: --variant prefetch:TIERLLM_L2_PREFETCH=1 \
        --no-reverse --timeout 400 2>"$OUT/prefetch_ab_tp$tp.err" | tee "$OUT/prefetch_ab_tp$tp.log"
    python3 benchmarks/timeline_segments.py "$OUT"/timeline-*.json
    ;;
  invariant)
    tp=$([ "$gpus" -ge 4 ] && echo 1,2,4 || echo 1,2)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py \
        tests/kernels/test_triton_kernels.py -k invariant 2>&1 | tee "$OUT/invariant_tests.log" | tail -8
    python3 benchmarks/tp_gpu.py --tp-sizes "$tp" --presets smollm2-1.7b,llama-13b --skip-70b --no-fp32-reference \
        --invariant 2>&1 | tee "$OUT/tp_gpu_invariant.log" | grep -v "^\s*$" | tail -25
    ;;
  *) echo "unknown part $part: micro, 13b, 70b, fused-tests, fused-ab, pdl-ab, chain-ab, base-ab, tuner-ab, sweeps," \
          "gate-up-sweeps, survey, step-ab, prefetch-ab or invariant" >&2; exit 2 ;;
esac
