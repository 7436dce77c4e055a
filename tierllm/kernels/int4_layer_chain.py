"""Batch-1 int4 decode: one layer's linears after attention as one persistent kernel (an experiment against the
separate GEMV kernels; benchmarks/int4_chain_ab.py times both).

Why: each of the four int4 GEMVs of a layer costs ~4 us more than its bytes at the copy rate (benchmarks/notes/
gpu-decode.md, twenty-seventh session): the launch, the first loads' latency and the tail of the wave. Here the
programs stay resident across the layer's phases, and each program loads its first weight step of the next GEMV
before it waits for that GEMV's input (the weights do not depend on the activations).

Phases, in order; programs meet at a device-wide barrier between two (a counter per phase: each program adds one
when its share is done; the next phase waits until the counter holds the grid size):
  0. attn -> xo                      (int4_prepared_x's half layout)
  1. h += o_proj(xo)                 (PAIRED: a program's rows r and r + hidden/2)
  2. rmsnorm(h) * g_post -> xg
  3. act = silu(gate(xg)) * up(xg)   (the gate rows r, the up rows r + inter)
  4. act -> xd
  5. h += down(xd)
  6. rmsnorm(h) * g_next -> xq       (the next layer's input norm)
  7. qkv = qkv_next(xq)              (PAIRED)
The GEMVs are quant_gemv's XHALF loop (_half_loads / _half_step, two row sets per thread), so the results match
the separate kernels' to fp32 rounding order.

All programs must be resident at once, or the barrier never fills: the launch takes the grid from the compiled
kernel's registers and warps (resident_programs). A barrier also gives up after SPIN_LIMIT polls and raises a flag
(counter slot PHASES) rather than hang; chain_layer's caller checks it (chain_failed). The CPU interpreter runs
programs one after another, so it runs one phase per launch (FIRST == LAST: no barriers)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON
from tierllm.kernels.int4_prepared_x import HALF_CHUNK, HALF_RUN_K, _whole_row, prepared_x_half_size

PHASES = 8
SPIN_LIMIT = 1 << 16           # polls per barrier before giving up (tens of ms; a healthy one takes tens)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels.int4_prepared_x import _normed_x
    from tierllm.kernels.quant_gemv import _half_loads, _half_step, _half_total

    _RUN_K = tl.constexpr(HALF_RUN_K)
    _CHUNK = tl.constexpr(HALF_CHUNK)
    _PHASES = tl.constexpr(PHASES)
    _SPIN_LIMIT = tl.constexpr(SPIN_LIMIT)

    @triton.jit
    def _arrive(counter_ptr, phase: tl.constexpr, BARRIERS: tl.constexpr):
        """This program's share of `phase` is done: every warp's stores first (the CTA barrier), then one release
        add at GPU scope."""
        if BARRIERS:
            tl.debug_barrier()
            tl.atomic_add(counter_ptr + phase, 1, sem="release", scope="gpu")

    @triton.jit
    def _wait(counter_ptr, phase: tl.constexpr, BARRIERS: tl.constexpr):
        """Until every program has arrived at `phase` (acquire: their stores are visible after it); after
        SPIN_LIMIT polls, the failure flag and on."""
        if BARRIERS:
            target = tl.num_programs(0)
            seen = tl.atomic_add(counter_ptr + phase, 0, sem="acquire", scope="gpu")
            polls = 0
            while (seen < target) & (polls < _SPIN_LIMIT):
                seen = tl.atomic_add(counter_ptr + phase, 0, sem="acquire", scope="gpu")
                polls += 1
            if seen < target:
                tl.atomic_max(counter_ptr + _PHASES, 1)

    @triton.jit
    def _prepare_phase(x_ptr, g_ptr, out_ptr, K: tl.constexpr, eps, NORM: tl.constexpr, BLOCK: tl.constexpr,
                       ROW: tl.constexpr):
        """int4_prepared_x's half layout of x (times rstd * g with NORM; ROW: as _normed_x's), BLOCK k per
        program, programs in turn."""
        half_ptr = out_ptr.to(tl.pointer_type(tl.float16))
        RUNS: tl.constexpr = BLOCK // _RUN_K
        for block in range(tl.program_id(0), tl.cdiv(K, BLOCK), tl.num_programs(0)):
            offs = block * BLOCK + tl.arange(0, BLOCK)
            mask = offs < K
            x = _normed_x(x_ptr, g_ptr, offs, mask, K, eps, NORM, BLOCK, ROW)                  # [BLOCK] fp32
            runs = tl.reshape(x, [RUNS, _RUN_K])
            largest = tl.max(tl.abs(runs), axis=1)                                         # [RUNS]
            exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127          # floor(log2), normal
            exponent = tl.minimum(tl.maximum(exponent, -100), 110)
            up = ((141 - exponent) << 23).to(tl.float32, bitcast=True)                     # 2^s, s = 14 - exponent
            i = offs % 8
            scaled = tl.reshape(runs * up[:, None], [BLOCK]) * tl.where(i % 2 == 1, 0.0625, 1.0)
            at = 2 * ((offs // _RUN_K) * _CHUNK + (i % 4) * 4 + (offs % _RUN_K) // 8) + i // 4
            tl.store(half_ptr + at, scaled.to(tl.float16), mask=mask)
            first = block * RUNS + tl.arange(0, RUNS)
            tail = tl.arange(0, 4)                                          # the factor, the sum, then padding
            factor = ((137 + exponent) << 23).to(tl.float32, bitcast=True)                 # 2^(24 - s)
            meta = tl.where(tail[None, :] == 0, factor[:, None],
                            tl.where(tail[None, :] == 1, tl.sum(runs, axis=1)[:, None], 0.0))
            tl.store(out_ptr + first[:, None] * _CHUNK + 16 + tail[None, :], meta,
                     mask=(first < K // _RUN_K)[:, None])

    @triton.jit
    def _first_loads(w_ptr, s_ptr, mn_ptr, SET_ROWS: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                     HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr, GPB: tl.constexpr):
        """The first step's weight loads of this program's first tile (two row sets, SET_ROWS apart)."""
        row = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        w0, s0, m0, w1, s1, m1, _, _, _, _, _, _ = _half_loads(
            w_ptr, s_ptr, mn_ptr, row, SET_ROWS, row < SET_ROWS, 0, K // GROUP, K // 2, K // GROUP, GROUP // 8, GPB,
            HAS_MINS, 2, False)
        return w0, s0, m0, w1, s1, m1

    @triton.jit
    def _gemv_phase(w0, s0, m0, w1, s1, m1, xp_ptr, w_ptr, s_ptr, mn_ptr, y_ptr, SET_ROWS: tl.constexpr,
                    K: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
                    GPB: tl.constexpr, EPILOGUE: tl.constexpr, EMULATE: tl.constexpr):
        """The program's tiles of BLOCK_N row pairs (r, r + SET_ROWS), programs in turn, the first tile's first
        step loaded already (w0 .. m1). EPILOGUE 0: y[r], y[r + SET_ROWS] = the two rows' results; 1: added to y
        (the residual); 2: y[r] = silu(first) * second."""
        WORDS: tl.constexpr = GROUP // 8
        RUNS: tl.constexpr = WORDS // 4
        num_groups: tl.constexpr = K // GROUP
        step = tl.num_programs(0) * BLOCK_N
        for tile in range(tl.program_id(0), tl.cdiv(SET_ROWS, BLOCK_N), tl.num_programs(0)):
            row = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            zero = tl.zeros([BLOCK_N, GPB, RUNS], tl.float32)
            a0, l0, a1, l1, _, _, _, _ = _half_step(
                zero, zero, zero, zero, zero, zero, zero, zero, w0, s0, m0, w1, s1, m1, w1, s1, m1, w1, s1, m1,
                xp_ptr, row, 0, num_groups, WORDS, RUNS, GPB, 2, False, EMULATE)
            for g0 in range(GPB, num_groups, GPB):
                v0, t0, n0, v1, t1, n1, _, _, _, _, _, _ = _half_loads(
                    w_ptr, s_ptr, mn_ptr, row, SET_ROWS, row < SET_ROWS, g0, num_groups, K // 2, num_groups, WORDS,
                    GPB, HAS_MINS, 2, False)
                a0, l0, a1, l1, _, _, _, _ = _half_step(
                    a0, l0, a1, l1, zero, zero, zero, zero, v0, t0, n0, v1, t1, n1, v1, t1, n1, v1, t1, n1,
                    xp_ptr, row, g0, num_groups, WORDS, RUNS, GPB, 2, False, EMULATE)
            following = row + step                               # the next tile's first step, before the epilogue
            w0, s0, m0, w1, s1, m1, _, _, _, _, _, _ = _half_loads(
                w_ptr, s_ptr, mn_ptr, following, SET_ROWS, following < SET_ROWS, 0, num_groups, K // 2, num_groups,
                WORDS, GPB, HAS_MINS, 2, False)
            first = _half_total(a0, l0, HAS_MINS)                                           # [BLOCK_N] fp32
            second = _half_total(a1, l1, HAS_MINS)
            ok = row < SET_ROWS
            if EPILOGUE == 2:
                tl.store(y_ptr + row, (first / (1.0 + tl.exp(-first)) * second).to(y_ptr.dtype.element_ty), mask=ok)
            else:
                if EPILOGUE == 1:
                    first += tl.load(y_ptr + row, mask=ok, other=0.0).to(tl.float32)
                    second += tl.load(y_ptr + SET_ROWS + row, mask=ok, other=0.0).to(tl.float32)
                tl.store(y_ptr + row, first.to(y_ptr.dtype.element_ty), mask=ok)
                tl.store(y_ptr + SET_ROWS + row, second.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _prepared_gemv(x_ptr, g_ptr, xp_ptr, w_ptr, s_ptr, mn_ptr, y_ptr, counter_ptr, eps, K: tl.constexpr,
                       NORM: tl.constexpr, SET_ROWS: tl.constexpr, EPILOGUE: tl.constexpr, PREP: tl.constexpr,
                       FIRST: tl.constexpr, LAST: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                       BLOCK_N: tl.constexpr, GPB: tl.constexpr, PREP_BLOCK: tl.constexpr, ROW: tl.constexpr,
                       EMULATE: tl.constexpr):
        """Phase PREP (x -> xp, after the phase before it) and phase PREP + 1 (the GEMV on xp into y), where they
        lie within FIRST .. LAST; the GEMV's first weight step is loaded before its wait for xp."""
        B: tl.constexpr = FIRST < LAST                                     # barriers between phases
        GEMV: tl.constexpr = PREP + 1
        if FIRST <= PREP and PREP <= LAST:
            if FIRST < PREP:
                _wait(counter_ptr, PREP - 1, B)
            _prepare_phase(x_ptr, g_ptr, xp_ptr, K, eps, NORM, PREP_BLOCK, ROW)
            if LAST > PREP:
                _arrive(counter_ptr, PREP, B)
        if FIRST <= GEMV and GEMV <= LAST:
            w0, s0, m0, w1, s1, m1 = _first_loads(w_ptr, s_ptr, mn_ptr, SET_ROWS, K, GROUP, HAS_MINS, BLOCK_N, GPB)
            if FIRST < GEMV:
                _wait(counter_ptr, PREP, B)
            _gemv_phase(w0, s0, m0, w1, s1, m1, xp_ptr, w_ptr, s_ptr, mn_ptr, y_ptr, SET_ROWS, K, GROUP, HAS_MINS,
                        BLOCK_N, GPB, EPILOGUE, EMULATE)
            if LAST > GEMV:
                _arrive(counter_ptr, GEMV, B)

    @triton.jit
    def _layer_chain_kernel(attn_ptr, h_ptr, act_ptr, qkv_ptr, xo_ptr, xg_ptr, xd_ptr, xq_ptr, g_post_ptr,
                            g_next_ptr, wo_ptr, so_ptr, mo_ptr, wgu_ptr, sgu_ptr, mgu_ptr, wd_ptr, sd_ptr, md_ptr,
                            wq_ptr, sq_ptr, mq_ptr, counter_ptr, eps, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                            QKV: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
                            GPB: tl.constexpr, PREP_BLOCK: tl.constexpr, ROW: tl.constexpr, FIRST: tl.constexpr,
                            LAST: tl.constexpr, EMULATE: tl.constexpr):
        """Phases FIRST .. LAST of the module doc (all of them, 0 .. 7, on a GPU; one per launch in the
        interpreter)."""
        _prepared_gemv(attn_ptr, g_post_ptr, xo_ptr, wo_ptr, so_ptr, mo_ptr, h_ptr, counter_ptr, eps, HIDDEN, False,
                       HIDDEN // 2, 1, 0, FIRST, LAST, GROUP, HAS_MINS, BLOCK_N, GPB, PREP_BLOCK, ROW, EMULATE)
        _prepared_gemv(h_ptr, g_post_ptr, xg_ptr, wgu_ptr, sgu_ptr, mgu_ptr, act_ptr, counter_ptr, eps, HIDDEN, True,
                       INTER, 2, 2, FIRST, LAST, GROUP, HAS_MINS, BLOCK_N, GPB, PREP_BLOCK, ROW, EMULATE)
        _prepared_gemv(act_ptr, g_post_ptr, xd_ptr, wd_ptr, sd_ptr, md_ptr, h_ptr, counter_ptr, eps, INTER, False,
                       HIDDEN // 2, 1, 4, FIRST, LAST, GROUP, HAS_MINS, BLOCK_N, GPB, PREP_BLOCK, ROW, EMULATE)
        _prepared_gemv(h_ptr, g_next_ptr, xq_ptr, wq_ptr, sq_ptr, mq_ptr, qkv_ptr, counter_ptr, eps, HIDDEN, True,
                       QKV // 2, 0, 6, FIRST, LAST, GROUP, HAS_MINS, BLOCK_N, GPB, PREP_BLOCK, ROW, EMULATE)


class ChainBuffers:
    """The chain's scratch for one (hidden, inter) shape: the four prepared-x buffers and the act vector."""

    def __init__(self, hidden: int, inter: int, device: torch.device, dtype: torch.dtype):
        words = dict(dtype=torch.float32, device=device)
        self.xo = torch.empty(prepared_x_half_size(hidden), **words)
        self.xg = torch.empty(prepared_x_half_size(hidden), **words)
        self.xd = torch.empty(prepared_x_half_size(inter), **words)
        self.xq = torch.empty(prepared_x_half_size(hidden), **words)
        self.act = torch.empty(inter, dtype=dtype, device=device)


def resident_programs(kernel, device: torch.device) -> int:
    """How many programs of a compiled kernel fit on the device at once (registers, warps, shared memory, blocks
    per SM), so that a grid of that size is resident and its barriers fill."""
    if getattr(kernel, "n_regs", None) is None:
        kernel._init_handles()                                          # loads the module: sets n_regs
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256                  # allocated per warp in units of 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * warps)
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    shared = kernel.metadata.shared
    by_shared = props.shared_memory_per_multiprocessor // shared if shared else by_warps
    per_sm = min(by_regs, by_warps, by_shared, 32)
    if per_sm < 1:
        raise RuntimeError(f"int4 layer chain: one program needs more than an SM ({kernel.n_regs} registers, "
                           f"{shared} bytes of shared memory)")
    return per_sm * props.multi_processor_count


_RESIDENT: dict[tuple, int] = {}              # the resident grid per device and launch meta


def chain_layer(attn: torch.Tensor, h: torch.Tensor, qkv: torch.Tensor, o: dict, gate_up: dict, down: dict,
                qkv_next: dict, g_post: torch.Tensor, g_next: torch.Tensor, counters: torch.Tensor,
                buffers: ChainBuffers, group_size: int, eps: float, *, block_n: int = 4, groups_per_block: int = 32,
                num_warps: int = 8, maxnreg: int | None = None, prep_block: int = 256, grid: int | None = None,
                emulate: bool = False, one_phase_per_launch: bool = False) -> None:
    """One layer's phases (module doc) on one decode row: attn [hidden], h [hidden] (the residual, updated in place)
    -> qkv [qkv rows]. o, gate_up, down, qkv_next: {"qweight", "scales", "mins"} as quantize_int4 writes them
    (gate_up: the gate rows then the up rows). counters: int32 [PHASES + 1], zero (the caller zeroes it before
    each launch, e.g. one memset per step for every layer's slice). maxnreg: ptxas's register cap (more programs
    resident). grid: the programs (default: as many as are resident). one_phase_per_launch: the interpreter's way
    (no barriers)."""
    hidden, inter = h.shape[-1], buffers.act.shape[0]
    has_mins = "mins" in o
    weights = []
    for linear in (o, gate_up, down, qkv_next):
        weights += [linear["qweight"], linear["scales"], linear.get("mins", linear["scales"])]
    meta = dict(HIDDEN=hidden, INTER=inter, QKV=qkv.shape[-1], GROUP=group_size, HAS_MINS=has_mins,
                BLOCK_N=block_n, GPB=groups_per_block, PREP_BLOCK=prep_block, ROW=_whole_row(hidden), EMULATE=emulate,
                num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    args = [attn, h, buffers.act, qkv, buffers.xo, buffers.xg, buffers.xd, buffers.xq, g_post, g_next, *weights,
            counters, eps]
    if one_phase_per_launch:
        for phase in range(PHASES):
            _layer_chain_kernel[(grid or 4,)](*args, FIRST=phase, LAST=phase, **meta)
        return
    if grid is None:
        key = (h.device, *sorted(meta.items()))
        if key not in _RESIDENT:
            compiled = _layer_chain_kernel.warmup(*args, FIRST=0, LAST=PHASES - 1, **meta, grid=(1,))
            _RESIDENT[key] = resident_programs(compiled, h.device)
        grid = _RESIDENT[key]
    _layer_chain_kernel[(grid,)](*args, FIRST=0, LAST=PHASES - 1, **meta)


def chain_failed(counters: torch.Tensor) -> bool:
    """Whether a barrier of the launches that used these counters gave up (not every program was resident)."""
    return bool(counters.view(-1, PHASES + 1)[:, PHASES].any())
