"""A row-parallel decode layer in one kernel: this rank's GEMV share, the all-reduce over the tensor-parallel
group, the bias and the residual add. residual[M, N] += (sum over ranks of x_r[M, K_r] @ W_r[N, K_r]^T + b),
rounded as kernels.add_rounded_ rounds (one rounding of the fp32 sum, then the add in the residual's dtype).

Why: at decode sizes an NCCL all-reduce of one token's hidden state is a latency-bound kernel of its own (7.5 us
per call on 2 H100s, twice per layer) followed by the residual-add kernel. Here each program exchanges its own
BLOCK_N outputs with the same program on the peers as soon as they are computed, while the rest of the grid still
streams weights: the exchange hides behind the GEMV, and two kernels per row-parallel layer disappear.

The exchange, per program (tile) and call, through a buffer that every rank of the host maps (symmetric memory,
distributed/fused_all_reduce.py; plain peer-to-peer stores, no NVLink multicast):
  1. write its fp32 partial into every peer's buffer, slot [parity][this rank][rows][tile's columns];
  2. signal each peer: its cell [this rank][tile] goes 0 -> 1 (compare-and-swap, release, system scope; it spins
     while the cell is still 1, i.e. until the peer took the previous signal);
  3. wait for each peer's signal on its own cells [peer][tile]: 1 -> 0 (acquire), which also resets them;
  4. add the ranks' partials in rank order (every rank gets the same bits), add the bias, round, add into the
     residual.
The parity (calls so far, modulo 2, counted on the device: the grid's last program advances it) keeps a rank that
runs ahead from writing into a slot its peer still reads: the slot of the same parity comes back only after the
peer has signalled the call in between, which it does only once it has finished this one.
Every rank must launch the same grid (the same BLOCK_N) for the tiles to pair up. A rank that never answers (its
process died) would leave the others spinning: the waits give up when the driver raises `status` (a pinned host
word) or after `timeout_ns`, and record why in `status`; the step's result is then garbage and the driver fails
the engine (distributed/driver.py)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted

# Buffer geometry shared with distributed/fused_all_reduce.py
MAX_ROWS = 8                 # decode-sized calls only (kernels.MAX_GEMV_ROWS)
MAX_COLS = 16384             # output features of a row-parallel layer (the model's hidden size)
BLOCK_N = 4                  # every rank must launch the same grid: one tile width for every call
MAX_TILES = MAX_COLS // BLOCK_N
STATUS_OK, STATUS_ABORTED, STATUS_TIMED_OUT = 0, 1, 2


def buffer_elements(world: int) -> tuple[int, int]:
    """(fp32 data elements, int32 signal cells) of one rank's symmetric buffer."""
    return 2 * world * MAX_ROWS * MAX_COLS, world * MAX_TILES


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels.gemv import dot_chunk

    @triton.jit
    def _globaltimer():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _swap_cell(cell, expected, desired, status_ptr, deadline, ACQUIRE: tl.constexpr, TIMED: tl.constexpr):
        """Spin until this program's compare-and-swap takes `cell` from expected to desired (system scope; acquire
        for a wait, release for a signal). Gives up once `status` is raised (every 256 tries: a host read) or,
        TIMED, past `deadline` (globaltimer ns), which it records in status."""
        if ACQUIRE:
            old = tl.atomic_cas(cell, expected, desired, sem="acquire", scope="sys")
        else:
            old = tl.atomic_cas(cell, expected, desired, sem="release", scope="sys")
        status = tl.full([], 0, tl.int32)
        tries = tl.full([], 0, tl.int32)
        while (old != expected) & (status == 0):
            if ACQUIRE:
                old = tl.atomic_cas(cell, expected, desired, sem="acquire", scope="sys")
            else:
                old = tl.atomic_cas(cell, expected, desired, sem="release", scope="sys")
            tries += 1
            if tries % 256 == 0:
                status = tl.load(status_ptr, volatile=True)
                if TIMED:
                    if _globaltimer() > deadline:
                        status = tl.full([], 2, tl.int32)                    # STATUS_TIMED_OUT
                        tl.store(status_ptr, status)

    @triton.jit
    def _gemv_all_reduce_kernel(x_ptr, w_ptr, s_ptr, b_ptr, res_ptr, bases_ptr, counter_ptr, status_ptr,
                                M, N, K, stride_xm, stride_wn, stride_rm, rank, timeout_ns,
                                WORLD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, TILES: tl.constexpr,
                                HAS_BIAS: tl.constexpr, INT8: tl.constexpr,
                                EXCHANGE: tl.constexpr, TIMED: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """bases_ptr: int64 [WORLD], every rank's buffer address in this process; counter_ptr: int32 [2] (calls,
        programs done), this rank's own; ROWS, COLS, TILES: the buffer geometry (MAX_ROWS, MAX_COLS, MAX_TILES). EXCHANGE=False: no communication, the sum is this rank's partial (the
        autotuner's twin; a one-rank group)."""
        tile = tl.program_id(0)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)                                  # this rank's partial
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0)                 # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_K]
            acc += dot_chunk(x, w, INT8)
        if INT8:
            acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        slot = offs_m[:, None] * COLS + offs_n[None, :]                                 # [BLOCK_M, BLOCK_N] in a slot
        total = acc
        if EXCHANGE:
            rank_stride: tl.constexpr = ROWS * COLS
            data_elems: tl.constexpr = 2 * WORLD * rank_stride                         # buffer_elements()[0]
            parity = tl.load(counter_ptr, volatile=True) % 2
            mine = parity * (WORLD * rank_stride) + rank * rank_stride + slot
            deadline = 0
            if TIMED:
                deadline = _globaltimer() + timeout_ns
            for peer in tl.static_range(WORLD):                                         # 1. partial to the peers
                if peer != rank:
                    base = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.float32))
                    tl.store(base + mine, acc, mask=mn_mask)
            tl.debug_barrier()                                                          # all threads' stores first
            for peer in tl.static_range(WORLD):                                         # 2. signal the peers
                if peer != rank:
                    cells = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.int32)) + data_elems
                    _swap_cell(cells + rank * TILES + tile, 0, 1, status_ptr, deadline, False, TIMED)
            own = tl.load(bases_ptr + rank)
            own_cells = own.to(tl.pointer_type(tl.int32)) + data_elems
            for peer in tl.static_range(WORLD):                                         # 3. wait for theirs
                if peer != rank:
                    _swap_cell(own_cells + peer * TILES + tile, 1, 0, status_ptr, deadline, True, TIMED)
            tl.debug_barrier()
            own_data = own.to(tl.pointer_type(tl.float32)) + parity * (WORLD * rank_stride)
            for peer in tl.static_range(WORLD):                                         # 4. sum in rank order
                if peer == rank:
                    part = acc
                else:
                    part = tl.load(own_data + peer * rank_stride + slot, mask=mn_mask, other=0.0, volatile=True)
                if peer == 0:
                    total = part
                else:
                    total = total + part
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = total.to(res_ptr.dtype.element_ty)                          # the rounding of reduce_partial_output
        res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
        residual = tl.load(res_ptrs, mask=mn_mask, other=0.0)
        tl.store(res_ptrs, (residual + y).to(res_ptr.dtype.element_ty), mask=mn_mask)
        if EXCHANGE:                                    # the grid's last program moves the parity on
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(0) - 1:
                tl.store(counter_ptr + 1, 0)
                tl.store(counter_ptr, tl.load(counter_ptr, volatile=True) + 1)

    # BLOCK_N is fixed (every rank launches the same grid); the rest is tuned per shape on the EXCHANGE=False twin.
    _CONFIGS = [triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bk, w, s in [(512, 4, 3), (1024, 4, 2), (1024, 8, 2), (2048, 4, 1), (2048, 8, 2), (4096, 4, 1)]]
    _tuner = triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M", "INT8"],
                             restore_value=["res_ptr"])(_gemv_all_reduce_kernel)


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
                     timeout_ns: int, configs: dict, scales: torch.Tensor | None = None) -> torch.Tensor:
    """residual [M, N] += sum over the group's ranks of x [M, K_r] @ weight [N, K_r]^T, plus bias [N], in place;
    returns residual. weight: fp16/bf16 (or int8 with per-channel `scales` [N]); M <= MAX_ROWS, N <= MAX_COLS.
    bases, counter, status, rank, world: distributed/fused_all_reduce.py's state; configs: its per-shape cache of
    tuned launch configs (filled here on a shape's first call, on the EXCHANGE=False twin: tuning must not
    communicate, the peers would not time the same runs)."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(1, triton.next_power_of_2(m))
    int8 = scales is not None
    args = (x, weight, scales if int8 else weight, bias if bias is not None else weight, residual, bases, counter,
            status, m, n, k, x.stride(0), weight.stride(0), residual.stride(0), rank, timeout_ns)
    flags = {"WORLD": world, "ROWS": MAX_ROWS, "COLS": MAX_COLS, "TILES": MAX_TILES, "HAS_BIAS": bias is not None,
             "INT8": int8, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N}
    grid = (triton.cdiv(n, BLOCK_N),)
    if is_interpreted():                                           # the interpreter cannot time configs
        _gemv_all_reduce_kernel[grid](*args, **flags, EXCHANGE=True, TIMED=False, BLOCK_K=128)
        return residual
    key = (n, k, block_m, int8, x.dtype)
    if key not in configs:
        scratch = args[:4] + (residual.clone(),) + args[5:]
        _tuner[grid](*scratch, **flags, EXCHANGE=False, TIMED=False)
        configs[key] = _tuner.best_config
    config = configs[key]
    _gemv_all_reduce_kernel[grid](*args, **flags, EXCHANGE=True, TIMED=True, BLOCK_K=config.kwargs["BLOCK_K"],
                                  num_warps=config.num_warps, num_stages=config.num_stages)
    return residual
