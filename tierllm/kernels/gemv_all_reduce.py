"""A row-parallel decode layer in one kernel: this rank's GEMV share, the all-reduce over the tensor-parallel
group, the bias and the residual add. residual[M, N] += (sum over ranks of x_r[M, K_r] @ W_r[N, K_r]^T + b),
rounded as kernels.add_rounded_ rounds (one rounding of the fp32 sum, then the add in the residual's dtype).

Why: at decode sizes an NCCL all-reduce of one token's hidden state is a latency-bound kernel of its own (7.4 us
per call on 2 H100s, twice per layer), followed by the residual-add kernel. Here the exchange rides on the GEMV.

The grid has `tiles` computing programs (a tile: BLOCK_N output columns, all M rows), then gathering programs of
GATHER_N columns each:
  - computing program t computes tile t of this rank's fp32 partial and writes it, flagged, into every rank's
    buffer (symmetric memory, distributed/fused_all_reduce.py: peer-to-peer stores, no NVLink multicast), slot
    [parity][this rank][rows][the tile's columns], and ends: it never waits, so the GEMV streams at full speed;
  - gathering program g waits until every rank's part of its GATHER_N columns is in this rank's buffer (one load of
    all of them per try), adds them in rank order (every rank gets the same bits), adds the bias, rounds, and adds
    into the residual.
The gathering programs are dispatched after the computing ones (programs start in grid order, as the GPU schedules
them; the waits rely on it, since waits that held every SM slot before the computing programs started would never
end), so by the time they run the first tiles have long arrived: only the last tiles' flight time and the ranks'
skew show. There are few of them (N / GATHER_N), so few SM slots spin and few atomics hit the call counter.
Each value travels as one 8-byte word: its fp32 bits and, in the high half, the call's epoch (NCCL's LL protocol):
a store of 8 aligned bytes lands whole, so a flag that reads the epoch vouches for its value, with no fence and no
signal. The epoch and the parity come from a call counter on the device (the last gathering program advances it,
once every program of the call has read it), the same on every rank. The parity keeps a rank that runs ahead from
overwriting a slot its peer still reads: the slot of the same parity comes back two calls later, and a rank
finishes the call in between only with its peers' parts of it, which they send only once they have finished this
one.
PDL, programmatic dependent launch (kernels/_dispatch.py), both ways:
  - every program lets the next kernel launch as it starts, so a next kernel launched with PDL (the
    column-parallel GEMV after it, gemv.py) starts pulling its weights while this one's last tiles fly and gather;
    it reads this kernel's results only after griddepcontrol.wait;
  - launched that way itself behind a kernel that lets it in early (the gate/up GEMV, the attention's last
    kernel), each computing program loads its first weight chunk, then waits, and only then reads x and the call
    counter (the previous call may still have been running before the wait); gathering programs wait first.
    Where K <= WHOLE_K the tuner picks among configs whose first chunk is the whole tile: o_proj's programs that
    start during the attention then hold their weights before they wait.
A rank that never sends (its process died) leaves the others waiting: the waits give up when the driver raises
`status` (a pinned host word) or after `timeout_ns`, and record why in `status`; the step's result is then
garbage and the driver fails the engine (distributed/driver.py)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, pdl_options
from tierllm.kernels.gemv import MAX_GEMV_ROWS
from tierllm.kernels.graph_tuning import graph_tuning, record_site, tune_site

# Buffer geometry shared with distributed/fused_all_reduce.py
MAX_ROWS = MAX_GEMV_ROWS     # decode-sized calls only: the ones the GEMV takes
MAX_COLS = 16384             # output features of a row-parallel layer (the model's hidden size)
GATHER_N = 128               # columns each gathering program finishes
WHOLE_K = 4096               # K up to which a program's first weight chunk is its whole tile
STATUS_OK, STATUS_ABORTED, STATUS_TIMED_OUT = 0, 1, 2


def buffer_words(world: int) -> int:
    """int64 words of one rank's symmetric buffer: [2 parities][world senders][MAX_ROWS][MAX_COLS]."""
    return 2 * world * MAX_ROWS * MAX_COLS


def flagged(values: torch.Tensor, epoch: int) -> torch.Tensor:
    """fp32 values -> the 8-byte words the kernel exchanges: the epoch above the value's bits (int64)."""
    return (values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (epoch << 32)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait
    from tierllm.kernels.gemv import gemv_chunk, weight_chunk

    @triton.jit
    def _globaltimer():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _gather_parts(own, offs_m, offs_g, M, N, epoch, status_ptr, deadline, WORLD: tl.constexpr,
                      WORLD_P2: tl.constexpr, RANK_WORDS: tl.constexpr, COLS: tl.constexpr, TIMED: tl.constexpr):
        """Every rank's part of columns offs_g, read from this rank's buffer (`own`: this call's parity slots) once
        all of its words carry `epoch`: their sum in rank order, [BLOCK_M, GATHER_N] fp32. Gives up once `status`
        is raised (every 256 tries: a host read) or, TIMED, past `deadline` (globaltimer ns), which it records in
        status."""
        senders = tl.arange(0, WORLD_P2)[:, None, None]
        ptrs = own + senders * RANK_WORDS + offs_m[None, :, None] * COLS + offs_g[None, None, :]
        mask = (senders < WORLD) & (offs_m < M)[None, :, None] & (offs_g < N)[None, None, :]
        arrived = epoch.to(tl.int64) << 32
        words = tl.load(ptrs, mask=mask, other=arrived, volatile=True)       # [WORLD_P2, BLOCK_M, GATHER_N]
        waiting = tl.max(tl.max(tl.max(((words >> 32).to(tl.int32) != epoch).to(tl.int32), axis=2), axis=1))
        status = tl.full([], 0, tl.int32)
        tries = tl.full([], 0, tl.int32)
        while (waiting != 0) & (status == 0):
            words = tl.load(ptrs, mask=mask, other=arrived, volatile=True)
            waiting = tl.max(tl.max(tl.max(((words >> 32).to(tl.int32) != epoch).to(tl.int32), axis=2), axis=1))
            tries += 1
            if tries % 256 == 0:
                status = tl.load(status_ptr, volatile=True)
                if TIMED:
                    if _globaltimer() > deadline:
                        status = tl.full([], 2, tl.int32)                    # STATUS_TIMED_OUT
                        tl.store(status_ptr, status)
        values = words.to(tl.int32).to(tl.float32, bitcast=True)
        total = tl.sum(tl.where(senders == 0, values, 0.0), axis=0)          # one rank's part, exactly
        for sender in tl.static_range(1, WORLD):
            total += tl.sum(tl.where(senders == sender, values, 0.0), axis=0)
        return total

    @triton.jit
    def _tile_chunk(acc, w, x_ptr, offs_m, k0, M, K, stride_xm, BLOCK_K: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] + x[:, k0:k0 + BLOCK_K] . w (the tile's weight chunk)^T: gemv.py's chunk, plain."""
        acc, _, _ = gemv_chunk(acc, acc, acc, w, w, x_ptr, x_ptr, offs_m, offs_m < M, k0, K, stride_xm, False, False,
                               False, BLOCK_K)
        return acc

    @triton.jit
    def _tile_partial(x_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_xm, stride_wn, PDL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """This rank's partial of one tile, x [M, K] @ W[offs_n, :]^T in fp32 [BLOCK_M, BLOCK_N] (gemv.py's loop).
        PDL: the first weight chunk is loaded, then gdc_wait(), and only then is x read."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_start = 0
        if PDL:
            w, _ = weight_chunk(w_ptr, offs_n, offs_n < N, 0, N, K, stride_wn, False, BLOCK_K)
            gdc_wait()
            acc = _tile_chunk(acc, w, x_ptr, offs_m, 0, M, K, stride_xm, BLOCK_K)
            k_start = BLOCK_K
        for k0 in range(k_start, K, BLOCK_K):
            w, _ = weight_chunk(w_ptr, offs_n, offs_n < N, k0, N, K, stride_wn, False, BLOCK_K)  # [BLOCK_N, BLOCK_K]
            acc = _tile_chunk(acc, w, x_ptr, offs_m, k0, M, K, stride_xm, BLOCK_K)
        return acc

    @triton.jit
    def _finish_tile(total, b_ptr, res_ptr, offs_m, offs_n, M, N, stride_rm, HAS_BIAS: tl.constexpr):
        """residual[rows offs_m, columns offs_n] += (total + bias) rounded to the residual's dtype
        (kernels.add_rounded_)."""
        mn_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y = total.to(res_ptr.dtype.element_ty)
        res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
        residual = tl.load(res_ptrs, mask=mn_mask, other=0.0)
        tl.store(res_ptrs, (residual + y).to(res_ptr.dtype.element_ty), mask=mn_mask)

    @triton.jit
    def _gemv_all_reduce_kernel(x_ptr, w_ptr, b_ptr, res_ptr, bases_ptr, counter_ptr, status_ptr,
                                M, N, K, stride_xm, stride_wn, stride_rm, rank, timeout_ns,
                                WORLD: tl.constexpr, WORLD_P2: tl.constexpr, ROWS: tl.constexpr,
                                COLS: tl.constexpr, HAS_BIAS: tl.constexpr, EXCHANGE: tl.constexpr,
                                TIMED: tl.constexpr, PDL: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GATHER_N: tl.constexpr):
        """bases_ptr: int64 [WORLD], every rank's buffer address in this process; counter_ptr: int32 [2] (calls,
        gathering programs done), this rank's own; WORLD_P2: WORLD rounded up to a power of 2; ROWS, COLS: the
        buffer geometry (MAX_ROWS, MAX_COLS). EXCHANGE=False: no communication, one program per tile finishing it
        with this rank's partial as the sum (the autotuner's twin). PDL: launched with programmatic dependent
        launch (module doc)."""
        if PDL:
            gdc_launch_dependents()
        pid = tl.program_id(0)
        tiles = tl.cdiv(N, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        if EXCHANGE:
            rank_words: tl.constexpr = ROWS * COLS
            if pid < tiles:                                    # compute this rank's part of the tile, send it
                offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = _tile_partial(x_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_xm, stride_wn, PDL, BLOCK_M,
                                    BLOCK_N, BLOCK_K)
                # Read after the wait (in _tile_partial): with PDL the previous call may still have been running
                # before it. This call's count cannot move on before this tile is sent: its gathering needs it.
                calls = tl.load(counter_ptr, volatile=True)
                parity_slots = (calls % 2) * (WORLD * rank_words)
                epoch = calls % 1073741824 + 1                 # never 0, the flag of a buffer never written
                words = (acc.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | (epoch.to(tl.int64) << 32)
                slot = rank * rank_words + offs_m[:, None] * COLS + offs_n[None, :]       # [BLOCK_M, BLOCK_N]
                mn_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
                for dest in tl.static_range(WORLD):                                   # every rank, this one too
                    base = tl.load(bases_ptr + dest).to(tl.pointer_type(tl.int64))
                    tl.store(base + parity_slots + slot, words, mask=mn_mask)
            else:                                              # gather GATHER_N columns, finish them
                if PDL:
                    gdc_wait()
                calls = tl.load(counter_ptr, volatile=True)
                parity_slots = (calls % 2) * (WORLD * rank_words)
                epoch = calls % 1073741824 + 1
                offs_g = (pid - tiles) * GATHER_N + tl.arange(0, GATHER_N)
                own = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int64)) + parity_slots
                deadline = 0
                if TIMED:
                    deadline = _globaltimer() + timeout_ns
                total = _gather_parts(own, offs_m, offs_g, M, N, epoch, status_ptr, deadline, WORLD, WORLD_P2,
                                      rank_words, COLS, TIMED)
                _finish_tile(total, b_ptr, res_ptr, offs_m, offs_g, M, N, stride_rm, HAS_BIAS)
                # The last gathering program moves the call counter on: every program of this call has read it by
                # then (each word gathered was stored by a program that had read it).
                done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
                if done == tl.num_programs(0) - tiles - 1:
                    tl.store(counter_ptr + 1, 0)
                    tl.store(counter_ptr, calls + 1)
        else:
            offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _tile_partial(x_ptr, w_ptr, offs_m, offs_n, M, N, K, stride_xm, stride_wn, PDL, BLOCK_M, BLOCK_N,
                                BLOCK_K)
            _finish_tile(acc, b_ptr, res_ptr, offs_m, offs_n, M, N, stride_rm, HAS_BIAS)

    # Tuned per shape on the EXCHANGE=False twin, each rank for itself (the ranks' tiles need not match: a part is
    # found by its columns), on a scratch copy of the residual; timed in CUDA graphs (graph_tuning.py, the
    # default), or by Triton's autotuner (TIERLLM_GEMV_TUNER=triton).
    # Not pruned as gemv.py's residual GEMVs of long rows are: on 2 H200s, llama-13b's down projection at TP=2 took
    # 27.5 us per layer with the one-row-per-warp configs against 25.2 with this whole list (its pick: 4 rows, 2
    # warps), its exchange counting (benchmarks/notes/tp-history.md).
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk, w, s in [(4, 512, 4, 3), (4, 1024, 4, 2), (8, 512, 4, 3), (8, 1024, 8, 2),
                                     (2, 2048, 4, 2), (4, 2048, 8, 2), (2, 4096, 4, 1), (4, 4096, 4, 1),
                                     (1, 1024, 2, 2), (2, 1024, 2, 2), (4, 1024, 2, 2), (1, 2048, 2, 2),
                                     (8, 1024, 2, 2), (8, 1024, 4, 2)]]
    _tuner = triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"])(_gemv_all_reduce_kernel)
    _WHOLE_K_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": WHOLE_K}, num_warps=w, num_stages=1)
                        for bn, w in [(1, 2), (2, 2), (1, 4), (2, 4), (4, 4), (4, 8), (8, 8)]]
    _whole_k_tuner = triton.autotune(configs=_WHOLE_K_CONFIGS, key=["N", "K", "BLOCK_M"])(_gemv_all_reduce_kernel)


def gemv_all_reduce_ref(partials: list[torch.Tensor], bias: torch.Tensor | None,
                        residual: torch.Tensor) -> torch.Tensor:
    """The kernel's result from every rank's fp32 partial [M, N] (rank order): a new tensor."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    y = total if bias is None else total + bias.float()
    return residual + y.to(residual.dtype)


def gemv_all_reduce_(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, *,
                     bases: torch.Tensor, counter: torch.Tensor, status: torch.Tensor, rank: int, world: int,
                     timeout_ns: int, configs: dict) -> torch.Tensor:
    """residual [M, N] += sum over the group's ranks of x [M, K_r] @ weight [N, K_r]^T, plus bias [N], in place;
    returns residual. x, weight, residual: fp16/bf16, one dtype; M <= MAX_ROWS, N <= MAX_COLS.
    bases, counter, status, rank, world: distributed/fused_all_reduce.py's state; configs: its per-shape cache of
    tuned launch configs (filled here on a shape's first call, on the EXCHANGE=False twin: tuning must not
    communicate, the peers would not time the same runs)."""
    m, k = x.shape
    n = weight.shape[0]

    def args(out: torch.Tensor, w: torch.Tensor = weight) -> tuple:
        return (x, w, bias if bias is not None else w, out, bases, counter, status, m, n, k, x.stride(0),
                w.stride(0), out.stride(0), rank, timeout_ns)

    flags = {"WORLD": world, "WORLD_P2": triton.next_power_of_2(world), "ROWS": MAX_ROWS, "COLS": MAX_COLS,
             "HAS_BIAS": bias is not None, "BLOCK_M": max(1, triton.next_power_of_2(m)), "GATHER_N": GATHER_N}
    if is_interpreted():                                           # the interpreter cannot time configs
        grid = (triton.cdiv(n, 4) + triton.cdiv(n, GATHER_N),)
        _gemv_all_reduce_kernel[grid](*args(residual), **flags, EXCHANGE=True, TIMED=False, PDL=False,
                                      BLOCK_N=4, BLOCK_K=128)
        return residual
    key = (n, k, flags["BLOCK_M"], x.dtype)
    if key not in configs:
        tuner = _whole_k_tuner if k <= WHOLE_K else _tuner
        scratch = residual.clone()
        if graph_tuning():                             # timed as decode runs it (graph_tuning.py), PDL as asked
            def launch(config, w: torch.Tensor) -> None:
                _gemv_all_reduce_kernel[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
                    *args(scratch, w), **flags, EXCHANGE=False, TIMED=False, **pdl_options(x), **config.all_kwargs())
            tune_site(configs, key, tuner.configs, launch, weight, flags["BLOCK_M"])
        else:
            timed_before = getattr(tuner, "configs_timings", None)
            tuner[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args(scratch), **flags, EXCHANGE=False,
                                                                    TIMED=False, PDL=False)
            configs[key] = tuner.best_config
            record_site(configs, key, tuner, timed_before, flags["BLOCK_M"])   # runner/step_tuning.py
    config = configs[key]
    grid = (triton.cdiv(n, config.kwargs["BLOCK_N"]) + triton.cdiv(n, GATHER_N),)   # compute tiles, then gather
    _gemv_all_reduce_kernel[grid](*args(residual), **flags, EXCHANGE=True, TIMED=True, **pdl_options(x),
                                  **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    return residual
