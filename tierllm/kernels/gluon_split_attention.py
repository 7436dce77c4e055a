"""Gluon device code for decode attention inside the persistent int4 kernels (benchmarks/int4_mma_step_probe.py and
benchmarks/int4_mma_attention_block_probe.py): one (head, split) of a sequence's cached tokens on the tensor cores
(_split_on_tensor_cores: K's blocks times q and V^T times p by mma.sync, bf16 in, fp32 out, the softmax in two
passes), the rotary embedding of a head's row of sums, and a CTA's share of a phase's items. Hopper (sm90) and a
Triton with Gluon; the probes check it on a GPU against fp32 references."""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    HAS_GLUON = True
except ImportError:                              # a Triton without Gluon: the kernels that need it are not offered
    HAS_GLUON = False


if HAS_GLUON:
    @gluon.jit
    def _share(pid, programs, slices: gl.constexpr, quads: gl.constexpr):
        """A CTA's part of a phase whose items are (quad, K slice): its slice pid % slices, its index r among that
        slice's CTAs, their count n, and its items (quads r, r + n, ..)."""
        s = pid % slices
        r = pid // slices
        n = (programs - s + slices - 1) // slices
        return s, r, n, gl.cdiv(quads - r, n)

    @gluon.jit
    def _rotated(row, cos_ptr, sin_ptr, d, rstd, HD: gl.constexpr):
        """x[d] (fp32 at row) rotated as the rotary embedding pairs dims (d, d + HD / 2), times rstd; d in any
        layout."""
        partner = (d + HD // 2) % HD
        sin = gl.load(sin_ptr + d).to(gl.float32) * gl.where(d < HD // 2, -1.0, 1.0)
        return (gl.load(row + d, cache_modifier=".cg") * gl.load(cos_ptr + d).to(gl.float32)
                + gl.load(row + partner, cache_modifier=".cg") * sin) * rstd

    @gluon.jit
    def _chunk_scores(k2, chunk, CH: gl.constexpr, q8_lo, q8_hi, scale, c, tok, blocks, b0, cached, AW: gl.constexpr,
                      BS: gl.constexpr, MMA: gl.constexpr, OPA: gl.constexpr):
        """A chunk's scores [ROWS] (K's two halves times q in all 8 columns; -1e30 for tokens past the split's blocks
        or the cache)."""
        score = mma_v2(k2.index(chunk).load(OPA), q8_lo, gl.zeros([AW * BS, 8], gl.float32, MMA))
        score = gl.max(mma_v2(k2.index(CH + chunk).load(OPA), q8_hi, score), axis=1) * scale
        local = c * AW + tok // BS
        return gl.where((local < blocks) & ((b0 + local) * BS + tok % BS < cached), score, -1e30)

    @gluon.jit
    def _split_on_tensor_cores(row, cos_ptr, sin_ptr, rstd, kbuf, vbuf, base: gl.constexpr, blocks, b0, cached, scale,
                               SLOTS: gl.constexpr, MAXB: gl.constexpr, AW: gl.constexpr, BS: gl.constexpr,
                               HD: gl.constexpr, DL: gl.constexpr, CHUNKS: gl.constexpr = 0):
        """_split_on_cuda_cores's result by mma.sync (bf16 in, fp32 out), AW blocks (ROWS tokens) at a time: the
        scores as K [ROWS, HD] times q (rotated from the sums' row, in bf16) in all 8 columns, the acc as V^T [HD,
        ROWS] times p (bf16) in all 8 columns, in two passes over the chunks. Each block's K and V are two boxes
        of HD / 2 dims (the slots' first and second halves), stored with 128-byte swizzles so that ldmatrix reads them
        without bank conflicts (rows of 256 bytes unswizzled put a matrix's 8 rows on the same banks). The result in
        layout DL. CHUNKS (if not 0) chunks of AW blocks instead of MAXB // AW: MAXB, a power of 2, may hold more
        than a split's blocks, and the chunks past them give nothing (their scores are -1e30, their p 0)."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[AW, 1], instr_shape=[16, 8])
        OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        COLS: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [AW, 1], [1, 0])
        ROWS: gl.constexpr = AW * BS
        RL: gl.constexpr = gl.SliceLayout(1, MMA)
        HB: gl.constexpr = HD // 2
        CH: gl.constexpr = SLOTS // AW                                              # chunks in a half
        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        k2 = kbuf._reinterpret(gl.bfloat16, [2 * CH, ROWS, HB], SW)                # [half, chunk] of AW blocks
        v2 = vbuf._reinterpret(gl.bfloat16, [2 * CH, ROWS, HB], SW)
        dims = gl.arange(0, HB, layout=gl.SliceLayout(1, COLS))
        q8_lo = gl.convert_layout((gl.expand_dims(_rotated(row, cos_ptr, sin_ptr, dims, rstd, HD), 1)
                                   + gl.zeros([HB, 8], gl.float32, COLS)).to(gl.bfloat16), OPB)     # [HB, 8]
        q8_hi = gl.convert_layout((gl.expand_dims(_rotated(row, cos_ptr, sin_ptr, dims + HB, rstd, HD), 1)
                                   + gl.zeros([HB, 8], gl.float32, COLS)).to(gl.bfloat16), OPB)
        tok = gl.arange(0, ROWS, layout=RL)
        # two passes, so that no chunk waits on the one before: the scores' max (elementwise over the chunks, one
        # reduction across the warps at the end), then the scores again, their exps and the acc
        tops = gl.full([ROWS], -1e30, gl.float32, RL)
        NC: gl.constexpr = CHUNKS if CHUNKS > 0 else MAXB // AW
        for c in gl.static_range(NC):                   # unrolled: the chunks' loads and MMAs interleave
            score = _chunk_scores(k2, base // AW + c, CH, q8_lo, q8_hi, scale, c, tok, blocks, b0, cached, AW, BS, MMA,
                                  OPA)
            tops = gl.maximum(tops, score)
        top = gl.max(tops, axis=0)
        totals = gl.zeros([ROWS], gl.float32, RL)
        acc_lo = gl.zeros([HB, 8], gl.float32, MMA)
        acc_hi = gl.zeros([HB, 8], gl.float32, MMA)
        for c in gl.static_range(NC):
            chunk = base // AW + c
            score = _chunk_scores(k2, chunk, CH, q8_lo, q8_hi, scale, c, tok, blocks, b0, cached, AW, BS, MMA, OPA)
            p = gl.where(score > -1e30, gl.exp(score - top), 0.0)
            totals += p
            p8 = gl.convert_layout((gl.expand_dims(p, 1) + gl.zeros([ROWS, 8], gl.float32, MMA)).to(gl.bfloat16), OPB)
            acc_lo = mma_v2(v2.index(chunk).permute((1, 0)).load(OPA), p8, acc_lo)       # V^T [HB, ROWS]
            acc_hi = mma_v2(v2.index(CH + chunk).permute((1, 0)).load(OPA), p8, acc_hi)
        total = gl.sum(totals, axis=0)
        out = gl.reshape(gl.permute(gl.join(gl.max(acc_lo, axis=1), gl.max(acc_hi, axis=1)), (1, 0)), [HD])
        return top, total, gl.convert_layout(out, DL)
