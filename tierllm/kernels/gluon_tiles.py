"""Gluon device code shared by the tensor-core int4 decode kernels (int4_step.py's decode-step kernel and the block
kernels of benchmarks/int4_mma_*_probe.py): the tile products of one item
(_item_dots: mma.sync m16n8k16 on the codes of tierllm/kernels/int4_tiles.py's layout against x's B fragments), x's
fragments made by a warp (_fragments), and the mbarrier and counter helpers their partitions use. Hopper (sm90) and
a Triton with Gluon; nothing here runs on a CPU (the layouts' arithmetic is emulated in torch by
int4_tiles.emulated, and the kernels are checked on a GPU by the probes against fp32 references)."""
from __future__ import annotations

from tierllm.kernels.int4_tiles import CG, MAGIC

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    HAS_GLUON = True
except ImportError:                              # a Triton without Gluon: the kernels that need it are not offered
    HAS_GLUON = False

SPIN_LIMIT = 1 << 20             # polls before a wait gives up and counts an error (a schedule bug, not a hang)
HANDOFFS = 4                     # items a consumer partition may hand to its counter warp ahead of the counts


def group_mma_asm() -> str:
    """PTX, pack=4: one (tile, group) of a lane. $4-$7: its words (row gid: words 2t, 2t+1; row gid + 8: the same);
    $8-$15: x's B pairs 4h + j. Out $0-$3: the group's C fragment (C[gid, 2t], C[gid, 2t + 1], C[gid + 8, 2t],
    C[gid + 8, 2t + 1]; the columns are equal). Word i's register j: nibbles j and j + 4 as 1024 + code (times 16
    for odd j)."""
    lines = ["{", ".reg .b32 a<16>, t, m;", ".reg .f32 z;", "mov.b32 m, 0x64006400;", "mov.f32 z, 0f00000000;"]
    for i in range(4):
        lines += [f"lop3.b32 a{4 * i}, ${4 + i}, 0x000F000F, m, 0xEA;",
                  f"lop3.b32 a{4 * i + 1}, ${4 + i}, 0x00F000F0, m, 0xEA;", f"shr.u32 t, ${4 + i}, 8;",
                  f"lop3.b32 a{4 * i + 2}, t, 0x000F000F, m, 0xEA;", f"lop3.b32 a{4 * i + 3}, t, 0x00F000F0, m, 0xEA;"]
    for s in range(4):
        h, jp = s // 2, 2 * (s % 2)
        a = [4 * h + jp, 4 * (2 + h) + jp, 4 * h + jp + 1, 4 * (2 + h) + jp + 1]
        c = "{z, z, z, z}" if s == 0 else "{$0, $1, $2, $3}"
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{$0, $1, $2, $3}}, "
                     f"{{a{a[0]}, a{a[1]}, a{a[2]}, a{a[3]}}}, {{${8 + 4 * h + jp}, ${9 + 4 * h + jp}}}, {c};")
    return "\n        ".join(lines + ["}"])


if HAS_GLUON:
    _MMA_ASM = gl.constexpr(group_mma_asm())
    _CG = gl.constexpr(CG)
    MAGIC_ = gl.constexpr(MAGIC)
    _SPIN = gl.constexpr(SPIN_LIMIT)
    _HANDOFFS = gl.constexpr(HANDOFFS)
    _PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    _PLAIN3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    _PLAIN4 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0]))
    _PLAIN5 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0]))

    def _warp_layouts(w: int) -> tuple:
        """The consumers' register layouts over [W (warp: tile), CG (group), 8 (gid), 4 (t), ...] for W = w warps,
        lane 4 gid + t: codes, x's B pairs, a value per group, a (scale, min) pair per lane's group, x's sums."""
        return tuple(gl.constexpr(layout) for layout in (
            gl.BlockedLayout([1, CG, 1, 1, 4], [1, 1, 8, 4, 1], [w, 1, 1, 1, 1], [4, 3, 2, 1, 0]),
            gl.BlockedLayout([1, CG, 1, 1, 8], [1, 1, 8, 4, 1], [w, 1, 1, 1, 1], [4, 3, 2, 1, 0]),
            gl.BlockedLayout([1, CG, 1, 1], [1, 1, 8, 4], [w, 1, 1, 1], [3, 2, 1, 0]),
            gl.BlockedLayout([1, 1, 1, 2], [1, 8, 4, 1], [w, 1, 1, 1], [3, 2, 1, 0]),
            gl.BlockedLayout([1, 1, 4], [1, 4, 8], [w, 1, 1], [1, 2, 0])))             # the last: lane t, group t

    _Q4_4, _Q8_4, _Q3_4, _QP_4, _QS_4 = _warp_layouts(4)
    _Q4_8, _Q8_8, _Q3_8, _QP_8, _QS_8 = _warp_layouts(8)

    @gluon.jit
    def _init_barriers(bars, COUNT: gl.constexpr, pair=None):
        """mbarriers 0 .. COUNT - 1 of bars (and of pair, alongside: a ring's ready and empty) set to one arrival."""
        for i in gl.static_range(COUNT):
            mbarrier.init(bars.index(i), count=1)
            if pair is not None:
                mbarrier.init(pair.index(i), count=1)

    @gluon.jit
    def _group_of_lane_w(c, t, M2: gl.constexpr):
        """c [W, CG, 8, 4] (each lane all CG groups' values) -> [W, 8, 4] in M2: lane t's group t's value."""
        W: gl.constexpr = c.shape[0]
        even, odd = gl.split(gl.reshape(gl.permute(c, [0, 2, 3, 1]), [W, 8, 4, 2, 2]))
        c0, c2 = gl.split(even)
        c1, c3 = gl.split(odd)
        c0 = gl.convert_layout(c0, M2, assert_trivial=True)
        c1 = gl.convert_layout(c1, M2, assert_trivial=True)
        c2 = gl.convert_layout(c2, M2, assert_trivial=True)
        c3 = gl.convert_layout(c3, M2, assert_trivial=True)
        return gl.where(t == 0, c0, gl.where(t == 1, c1, gl.where(t == 2, c2, c3)))

    @gluon.jit
    def _fragments(v, G_: gl.constexpr, frags, sums):
        """x values v fp32 [G_, 8, 2, 4] (group, word, e, j: x[64 g + 8 w + 4 e + j]) -> frags (shared int32 [G_, 32]:
        pair 4 w + j = (v[.., 0, j], v[.., 1, j]) / m_j as fp16 bits) and sums (shared fp32 [G_, 4]: X0, X1, 0, 0),
        x_fragments' arithmetic, by one warp."""
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, v.type.layout))))
        halves = (v * gl.where(j % 2 == 1, 0.0625, 1.0)[None, None, None, :]).to(gl.float16)
        bits = halves.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        lo, hi = gl.split(gl.permute(bits, [0, 1, 3, 2]))                                     # e 0, e 1: [G_, 8, 4]
        FL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
        frags.store(gl.convert_layout(gl.reshape(lo | (hi << 16), [G_, 32]), FL))
        x0 = gl.sum(gl.sum(gl.sum(v, axis=3), axis=2), axis=1)
        x1 = MAGIC_ * gl.sum(gl.sum(gl.sum(halves.to(gl.float32), axis=3), axis=2), axis=1)
        SL: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
        k = gl.arange(0, 4, layout=gl.SliceLayout(0, SL))[None, :]
        x0 = gl.convert_layout(x0, gl.SliceLayout(1, SL))[:, None]
        x1 = gl.convert_layout(x1, gl.SliceLayout(1, SL))[:, None]
        sums.store(gl.where(k == 0, x0, gl.where(k == 1, x1, 0.0)))

    @gluon.jit
    def _value_offsets(G_: gl.constexpr):
        """Offsets 64 g + 8 w + 4 e + j of [G_, 8, 2, 4] in one warp's layout (values of a slice's groups)."""
        V: gl.constexpr = gl.BlockedLayout([1, 1, 2, 4], [4, 8, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
        g = gl.arange(0, G_, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, V))))
        w = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, V))))
        e = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, V))))
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, V))))
        return (g[:, None, None, None] * 64 + w[None, :, None, None] * 8 + e[None, None, :, None] * 4
                + j[None, None, None, :])

    @gluon.jit
    def _wait_count(counts_ptr, errors_ptr, chunk, target):
        """Poll chunk's counter (acquire; each on its own 128-byte line, polls backing off) until target items are
        counted; give up after _SPIN polls and count an error."""
        counter = counts_ptr + chunk * 32
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        polls = 0
        while (seen < target) & (polls < _SPIN):
            gl.inline_asm_elementwise("nanosleep.u32 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            polls += 1
        if seen < target:
            gl.atomic_add(errors_ptr, 1, sem="relaxed", scope="gpu")

    @gluon.jit
    def _item_dots(codes, pairs, xf, xs, W: gl.constexpr, KS: gl.constexpr):
        """One item's sums [W, 8, 4] (rows gid, gid + 8 of warp w's tile; lane t: its groups'), its KS groups in
        chunks of CG: the tensor-core products and lane t's epilogue of group t, as int4_mma_ring_probe's."""
        Q4: gl.constexpr = _Q4_4 if W == 4 else _Q4_8
        Q8: gl.constexpr = _Q8_4 if W == 4 else _Q8_8
        Q3: gl.constexpr = _Q3_4 if W == 4 else _Q3_8
        QP: gl.constexpr = _QP_4 if W == 4 else _QP_8
        QS: gl.constexpr = _QS_4 if W == 4 else _QS_8
        M2: gl.constexpr = gl.SliceLayout(1, Q3)
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, M2)))[None, None, :]
        lo = gl.zeros([W, 8, 4], gl.float32, M2)
        hi = gl.zeros([W, 8, 4], gl.float32, M2)
        for c in gl.static_range(KS // _CG):
            words = codes._reinterpret(gl.int32, [W, KS, 8, 4, 4], _PLAIN5).slice(c * _CG, _CG, dim=1).load(Q4)
            pair = pairs._reinterpret(gl.int32, [W, KS, 8, 2], _PLAIN4).slice(c * _CG, _CG, dim=1).permute(
                (0, 2, 1, 3)).load(QP)                                             # lane (gid, t): group t's pair
            pair_lo, pair_hi = gl.split(pair)
            pair_lo = gl.convert_layout(pair_lo, M2, assert_trivial=True)
            pair_hi = gl.convert_layout(pair_hi, M2, assert_trivial=True)
            even, odd = gl.split(gl.reshape(xs.slice(c * _CG, _CG).load(gl.SliceLayout(0, QS)), [_CG, 2, 2]))
            x0, _ = gl.split(even)
            x1, _ = gl.split(odd)
            x0 = gl.convert_layout(x0, gl.SliceLayout(0, gl.SliceLayout(1, M2)), assert_trivial=True)[None, None, :]
            x1 = gl.convert_layout(x1, gl.SliceLayout(0, gl.SliceLayout(1, M2)), assert_trivial=True)[None, None, :]
            xb = xf._reinterpret(gl.int32, [KS, 4, 8], _PLAIN3).slice(c * _CG, _CG).load(
                gl.SliceLayout(0, gl.SliceLayout(2, Q8)))
            xb = gl.broadcast(gl.expand_dims(gl.expand_dims(xb, 0), 2), gl.full([W, _CG, 8, 4, 8], 0, gl.int32, Q8))[0]
            b0, b1 = gl.split(gl.permute(gl.reshape(xb, [W, _CG, 8, 4, 2, 4]), [0, 1, 2, 3, 5, 4]))
            b0 = gl.convert_layout(b0, Q4, assert_trivial=True)
            b1 = gl.convert_layout(b1, Q4, assert_trivial=True)
            out = gl.inline_asm_elementwise(asm=_MMA_ASM, constraints="=r,=r,=r,=r," + "r," * 11 + "r",
                                            args=[words, b0, b1], dtype=gl.float32, is_pure=True, pack=4)
            col0, _ = gl.split(gl.reshape(out, [W, _CG, 8, 4, 2, 2]))
            c_lo, c_hi = gl.split(col0)
            s_lo = (pair_lo & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
            m_lo = ((pair_lo >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
            s_hi = (pair_hi & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
            m_hi = ((pair_hi >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
            lo += s_lo * (_group_of_lane_w(gl.convert_layout(c_lo, Q3, assert_trivial=True), t, M2) - x1) + m_lo * x0
            hi += s_hi * (_group_of_lane_w(gl.convert_layout(c_hi, Q3, assert_trivial=True), t, M2) - x1) + m_hi * x0
        return lo, hi
