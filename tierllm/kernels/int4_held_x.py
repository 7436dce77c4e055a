"""HELD: the XHALF int4 GEMV (int4_half_dot.py) for one x row whose K fits one step, as a persistent kernel that
loads x once per program and holds it in registers for all the row blocks the program takes.

Why: in the XHALF loop (quant_gemv._half_dot) each program reloads x's planes for its few rows, and at batch 1
those loads cost 1.6-3.6 us of a llama-7b GEMV on an H200 even with four rows per thread sharing them (the Gluon
probe, benchmarks/int4_gluon_probe.py: its "no_x" mode against "gemv"). A persistent program holding x (the probe's
"x_once") took gate/up (ungated) from 18.0 us with XHALF's preparing kernel to 15.4, qkv from 12.6 to 10.4
(benchmarks/results/int4-gluon-probe-x-once-h200.json).

Layout: a block's weight words load as [2 runs, BLOCK_N rows, GPB groups, 4 words] int32 (a group of 64 codes is 8
words, 2 runs of 4): with the runs in the slowest dimension each thread holds both runs of its group for its rows
(offline, Triton 3.6, sm90, 4 warps: 8 rows x 64 groups give each thread 4 rows x 32 bytes), so that its x planes,
factors and sums (held) and each (row, group) scale and min serve 32 weight bytes. The next block's weights load
while a block's products are summed and stored (the first block's before the PDL wait). Row blocks past N repeat
row N - 1 (loaded, never stored). GATED: the up rows N + r in a second tile of the same layout.

y[r] = sum_g scale[r, g] * (factor_g0 * dot(r, run 0) + factor_g1 * dot(r, run 1)) + min[r, g] * (sum of x over g),
then quant_gemv's fused epilogue (rstd from the runs' sums of squares with NORM, bias, SiLU-and-mul, residual).

ROTARY (a QKV projection at batch 1, even BLOCK_N): each block's rows are pairs (d, d + head_dim / 2) of one head
(_pair_rows), so that its epilogue rotates q and k as rotary.py's kernel does (the same bits) and writes k and v to
their cache slot: the decode step then runs no rotary kernel between the QKV GEMV and the attention."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON

HELD_MAX_GROUPS = 64                 # x's planes of at most this many groups held per program (registers)


def programs_per_sm(registers: int, shared: int, warps: int, register_file: int = 65536, threads: int = 2048,
                    shared_memory: int = 233472) -> int:
    """Programs of `warps` warps that an SM holds at once with `registers` per thread (allocated per warp, 256 at
    a time) and `shared` bytes each, at most 32 (the hardware's block limit)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    fits = min(register_file // per_warp // warps, threads // (32 * warps), shared_memory // shared if shared else 32)
    return max(1, min(fits, 32))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait
    from tierllm.kernels.gemv import fused_epilogue
    from tierllm.kernels.int4_half_dot import split_run_dots
    from tierllm.kernels.int4_prepared_x import HALF_CHUNK
    from tierllm.kernels.rotary import rotated_in_kernel
    from tierllm.kernels.w4_mma_gemv import masked_load

    _CHUNK = tl.constexpr(HALF_CHUNK)

    @triton.jit
    def _group_index(GPB: tl.constexpr):
        """Each group's run and word positions: g [1, 1, GPB, 1], run [2, 1, 1, 1], word [1, 1, 1, 4]."""
        g = tl.arange(0, GPB)[None, None, :, None]
        run = tl.arange(0, 2)[:, None, None, None]
        word = tl.arange(0, 4)[None, None, None, :]
        return g, run, word

    @triton.jit
    def _block_loads(w_ptr, s_ptr, mn_ptr, rows, num_groups, stride_wn, stride_sn, GPB: tl.constexpr,
                     HAS_MINS: tl.constexpr, EVEN: tl.constexpr):
        """Rows `rows` (int64 [BLOCK_N], inside the weight): their words [2, BLOCK_N, GPB, 4] int32 and group
        scales and mins [BLOCK_N, GPB] fp32 (symmetric: -8 * scale); groups past K masked unless EVEN."""
        g, run, word = _group_index(GPB)
        at = rows[None, :, None, None] * (stride_wn // 4) + g * 8 + run * 4 + word
        MASK: tl.constexpr = not EVEN
        words = masked_load(w_ptr.to(tl.pointer_type(tl.int32)) + at, g < num_groups, MASK)
        groups = tl.arange(0, GPB)[None, :]
        s_at = rows[:, None] * stride_sn + groups
        scale = masked_load(s_ptr + s_at, groups < num_groups, MASK).to(tl.float32)
        low = -8.0 * scale
        if HAS_MINS:
            low = masked_load(mn_ptr + s_at, groups < num_groups, MASK).to(tl.float32)
        return words, scale, low

    @triton.jit
    def _words(t):
        """[2, BLOCK_N, GPB, 4] -> its four words, [2, BLOCK_N, GPB] each."""
        even, odd = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))     # words 0, 2 | 1, 3
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        return w0, w1, w2, w3

    @triton.jit
    def _block_dot(words, scale, low, x0, x1, x2, x3, factor, x_sum, EMULATE: tl.constexpr):
        """One tile's rows: each run's packed-fp16 dot product (int4_half_dot's PTX, or its emulation), times the
        run's factor, summed over the group's two runs; times the group's scale, plus its min times x's sum over
        the group; summed over the groups -> [BLOCK_N] fp32."""
        w0, w1, w2, w3 = _words(words)
        a0, a1, a2, a3 = _words(x0)
        b0, b1, b2, b3 = _words(x1)
        c0, c1, c2, c3 = _words(x2)
        d0, d1, d2, d3 = _words(x3)
        dots = split_run_dots(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                              EMULATE)                                                   # [2, BLOCK_N, GPB]
        group_dots = tl.sum(dots * factor, axis=0)                                      # [BLOCK_N, GPB]
        return tl.sum(group_dots * scale + low * x_sum, axis=1)

    @triton.jit
    def _pair_rows(i, HALF: tl.constexpr):
        """ROTARY: a block's i-th row -> its weight row: rows 2p and 2p + 1 are d and d + HALF of head h, where
        p = h * HALF + d (a permutation of each 2 * HALF rows: of N, a multiple of them, and of the rows past N)."""
        u = i.to(tl.uint32)                          # unsigned: // and % by powers of 2 become shifts and masks
        pair = u // 2
        return ((pair // HALF) * (2 * HALF) + pair % HALF + (u % 2) * HALF).to(i.dtype)

    @triton.jit
    def _first_of_pairs(t):
        """[BLOCK_N] of a block's pairs of rows (_pair_rows) -> [BLOCK_N / 2]: the first of each pair (dim d's)."""
        return tl.split(tl.reshape(t, [t.shape[0] // 2, 2]))[0]

    @triton.jit
    def _rotary_tables(cos_ptr, sin_ptr, rows, HALF: tl.constexpr):
        """ROTARY: the step's cos and sin at a block's pairs (rows: its _pair_rows, or any valid rows) -> fp32
        [BLOCK_N / 2] each (their halves are equal). Loaded with the block's weights: in the epilogue they would
        add an L2 round trip to each program's first block."""
        d = _first_of_pairs(rows) % HALF
        return tl.load(cos_ptr + d).to(tl.float32), tl.load(sin_ptr + d).to(tl.float32)

    @triton.jit
    def _rotary_store(val, rows, n_mask, c, s, y_ptr, kc_ptr, vc_ptr, slot, Q_ROWS, KV_ROWS, HALF: tl.constexpr,
                      EMULATE: tl.constexpr):
        """ROTARY's epilogue: val [BLOCK_N] (y's dtype) of rows `rows` (_pair_rows) -> q's and k's pairs rotated
        by the step's cos and sin at them (c, s: _rotary_tables; rotary.py's rounding), stored to y, and k's and
        v's also to their cache slot (rows Q_ROWS.. are k's, Q_ROWS + KV_ROWS.. v's; caches [slot, KV_ROWS] flat;
        no cache write at slot -1)."""
        PAIRS: tl.constexpr = val.shape[0] // 2
        first, second = tl.split(tl.reshape(val, [PAIRS, 2]))                           # dims d, d + HALF
        row = _first_of_pairs(rows)                                                     # [PAIRS]: d's rows
        ok = _first_of_pairs(n_mask)
        turned1, turned2 = rotated_in_kernel(first, second, c, s, EMULATE)
        rotate = row < Q_ROWS + KV_ROWS                                                 # q and k, not v
        first = tl.where(rotate, turned1, first)
        second = tl.where(rotate, turned2, second)
        tl.store(y_ptr + row, first, mask=ok)
        tl.store(y_ptr + row + HALF, second, mask=ok)
        if slot >= 0:
            kv = row - Q_ROWS                                                           # k: [0, KV_ROWS)
            at = tl.where(kv < KV_ROWS, kc_ptr + slot * KV_ROWS + kv, vc_ptr + slot * KV_ROWS + kv - KV_ROWS)
            tl.store(at, first, mask=ok & (kv >= 0))
            tl.store(at + HALF, second, mask=ok & (kv >= 0))

    @triton.jit
    def w4_held_x_kernel(xp_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_sn, eps,
                         cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, Q_ROWS, KV_ROWS,
                         GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         GATED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUPS_PER_BLOCK: tl.constexpr, PERSIST: tl.constexpr, EVEN: tl.constexpr = False,
                         PDL: tl.constexpr = False, EMULATE: tl.constexpr = False, ROTARY: tl.constexpr = 0):
        """y[:N] (+)= epilogue(x @ dequant(W)[rows]^T) for one x row prepared in int4_prepared_x's half layout
        (xp_ptr), groups of GROUP = 64 codes, K's groups in one step of GROUPS_PER_BLOCK (a power of 2, masked
        past K unless EVEN); program p of P (the grid's second axis: PERSIST per SM, held_programs)
        takes row blocks p, p + P, ... (module doc). ROTARY = head_dim / 2 (else 0): the QKV epilogue of the
        module doc, with the step's cos and sin [head_dim] (cos_ptr, sin_ptr), the caches, the token's slot
        (slot_ptr) and Q_ROWS, KV_ROWS: q's and k's rows (the rest of N is v's); without it those are not read."""
        tl.static_assert(GROUP == 64, "HELD: groups of 64 codes (2 runs of 4 words)")
        tl.static_assert(ROTARY == 0 or (BLOCK_N % 2 == 0 and not (GATED or RESIDUAL)),
                         "HELD ROTARY: pairs of rows in each block, y written")
        num_groups = K // GROUP
        stride = tl.num_programs(1) * BLOCK_N
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        out_rows = offs_n                        # the block's rows of y (ROTARY: pairs; past N where offs_n is)
        if ROTARY:
            out_rows = _pair_rows(offs_n, ROTARY)
            slot = tl.load(slot_ptr)             # written before the step's first kernel, by none of the chain
        rows = tl.minimum(out_rows, N - 1).to(tl.int64)
        if PDL:
            gdc_launch_dependents()
        words, scale, low = _block_loads(w_ptr, s_ptr, mn_ptr, rows, num_groups, stride_wn, stride_sn,
                                         GROUPS_PER_BLOCK, HAS_MINS, EVEN)
        words_up, scale_up, low_up = words, scale, low
        if GATED:
            words_up, scale_up, low_up = _block_loads(w_ptr, s_ptr, mn_ptr, rows + N, num_groups, stride_wn,
                                                      stride_sn, GROUPS_PER_BLOCK, HAS_MINS, EVEN)
        if PDL:
            gdc_wait()
        if ROTARY:
            c, s = _rotary_tables(cos_ptr, sin_ptr, rows, ROTARY)
        g, run, word = _group_index(GROUPS_PER_BLOCK)
        in_k = g < num_groups
        x_at = (g * 2 + run) * _CHUNK + word                                             # [2, 1, GPB, 4]
        xi = xp_ptr.to(tl.pointer_type(tl.int32))
        MASK: tl.constexpr = not EVEN
        x0 = masked_load(xi + x_at, in_k, MASK)
        x1 = masked_load(xi + x_at + 4, in_k, MASK)
        x2 = masked_load(xi + x_at + 8, in_k, MASK)
        x3 = masked_load(xi + x_at + 12, in_k, MASK)
        run_at = (g * 2 + run) * _CHUNK + 16                                             # [2, 1, GPB, 1]
        factor = tl.sum(masked_load(xp_ptr + run_at, in_k, MASK), axis=3)                # [2, 1, GPB]
        x_sum = tl.sum(tl.sum(masked_load(xp_ptr + run_at + 1, in_k, MASK), axis=3), axis=0)     # [1, GPB]
        total = 0.0
        if NORM:
            total = tl.sum(masked_load(xp_ptr + run_at + 2, in_k, MASK))
        for _ in range(tl.program_id(1) * BLOCK_N, N, stride):
            acc = _block_dot(words, scale, low, x0, x1, x2, x3, factor, x_sum, EMULATE)
            acc_up = acc
            if GATED:
                acc_up = _block_dot(words_up, scale_up, low_up, x0, x1, x2, x3, factor, x_sum, EMULATE)
            next_n = offs_n + stride                       # the next block's loads before this one's epilogue
            next_rows = _pair_rows(next_n, ROTARY) if ROTARY else next_n
            rows = tl.minimum(next_rows, N - 1).to(tl.int64)
            words, scale, low = _block_loads(w_ptr, s_ptr, mn_ptr, rows, num_groups, stride_wn, stride_sn,
                                             GROUPS_PER_BLOCK, HAS_MINS, EVEN)
            if GATED:
                words_up, scale_up, low_up = _block_loads(w_ptr, s_ptr, mn_ptr, rows + N, num_groups, stride_wn,
                                                          stride_sn, GROUPS_PER_BLOCK, HAS_MINS, EVEN)
            if ROTARY:
                c_next, s_next = _rotary_tables(cos_ptr, sin_ptr, rows, ROTARY)
            n_mask = offs_n < N
            out = fused_epilogue(acc, acc_up, total, b_ptr, out_rows, n_mask, N, K, eps, HAS_BIAS, NORM, GATED)
            if ROTARY:
                _rotary_store(out.to(y_ptr.dtype.element_ty), out_rows, n_mask, c, s, y_ptr, kc_ptr, vc_ptr, slot,
                              Q_ROWS, KV_ROWS, ROTARY, EMULATE)
                c, s = c_next, s_next
            else:
                if RESIDUAL:
                    out += tl.load(y_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)
            offs_n = next_n
            out_rows = next_rows

    def held_programs(blocks: int, per_sm: int, device: torch.device) -> int:
        """A launch's programs: per_sm per SM (two SMs' worth under the interpreter, so that programs take several
        blocks in the CPU tests), at most one per row block."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        return max(1, min(blocks, per_sm * sms))

    _RESIDENT: dict = {}            # (launch options, argument types) -> programs per SM that fit at once

    def launch_held(args: tuple, options: dict, blocks: int, device: torch.device) -> None:
        """w4_held_x_kernel on `blocks` row blocks with options["PERSIST"] programs per SM, or fewer where its
        compiled registers or shared memory do not let that many stay resident at once: a program past those would
        start only when another ends, a second wave behind the first. (A config's PERSIST cannot know its kernel's
        registers: the gated, norm and residual forms of one BLOCK_N take 120-250 per thread offline.)"""
        per_sm = options["PERSIST"]
        if device.type == "cuda":
            key = (tuple(sorted(options.items())),
                   tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args))
            fits = _RESIDENT.get(key)
            if fits is None:
                compiled = w4_held_x_kernel.warmup(*args, grid=(1, 1), **options)
                compiled._init_handles()                             # its register count comes with the module
                props = torch.cuda.get_device_properties(device)
                fits = _RESIDENT[key] = programs_per_sm(
                    compiled.n_regs, compiled.metadata.shared, options["num_warps"],
                    getattr(props, "regs_per_multiprocessor", 65536),
                    getattr(props, "max_threads_per_multi_processor", 2048),
                    getattr(props, "shared_memory_per_multiprocessor", 233472))
            per_sm = min(per_sm, fits)
        w4_held_x_kernel[(1, held_programs(blocks, per_sm, device))](*args, **options)

    def held_rotary_args(rotary, n: int, out: torch.Tensor) -> tuple:
        """w4_held_x_kernel's rotary arguments (cos, sin, k cache, v cache, slot mapping, Q_ROWS, KV_ROWS) for a
        rotary.DecodeRotary on a projection of n rows; without one, stand-ins it does not read (out, zeros)."""
        if rotary is None:
            return (out, out, out, out, out, 0, 0)
        return (rotary.cos, rotary.sin, rotary.k_cache, rotary.v_cache, rotary.slot_mapping,
                n - 2 * rotary.kv_rows, rotary.kv_rows)

    def held_configs(k: int, group_size: int) -> list:
        """The HELD kernel's configs for K = k: GROUPS_PER_BLOCK = K's groups (a power of 2) where that is at most
        HELD_MAX_GROUPS and the groups hold 64 codes; else none. (BLOCK_N, warps, programs per SM): rows per thread
        (4 warps spread 2 x 2 over rows and groups at 64 groups) and occupancy (offline: 8 rows x 4 warps take ~250
        registers per thread ungated; launch_held lowers the programs per SM to what fits)."""
        groups = triton.next_power_of_2(max(1, k // group_size))
        if group_size != 64 or k % group_size or groups > HELD_MAX_GROUPS:
            return []
        return [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": groups, "PERSIST": per_sm}, num_warps=w,
                              num_stages=1)
                # the smallest were the fastest on llama-7b's gate/up and qkv (an H200, session 32:
                # int4-held-tuner-timings-h200.json); (4, 4, 2), (2, 4, 4) and (8, 8, 1) timed 21-23 us there against
                # 17.0 for the best and made way for smaller ones, of which (1, 1, 16) was the fastest on both in
                # session 33 (quant-bf16-int4-held-small-llama-7b-h200.json)
                for bn, w, per_sm in [(8, 4, 2), (4, 4, 3), (4, 2, 4), (2, 2, 6), (2, 2, 8), (4, 8, 2), (2, 1, 8),
                                      (2, 1, 12), (1, 1, 16)]]
