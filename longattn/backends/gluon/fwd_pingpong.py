"""An sm90 forward kernel in Gluon for measurement, not routed: :mod:`fwd`'s kernel for dense calls (causal, windows,
grouped-query heads; D = 64 or 128; bf16/fp16), its consumers rebuilt so that the overlaps FlashAttention-3/4 have
on Hopper survive into the machine code. Nothing plans calls onto it (``longattn.backends.triton.planner`` does not
know it); ``tools/ab_gluon_forward.py`` checks and times it against :mod:`fwd`'s kernel.

Why (docs/kernel_notes.md, section of 2026-11-29): :mod:`fwd` issues ``S_c = Q K_c^T`` and ``O += P_{c-1} V_{c-1}``
together and runs block ``c``'s softmax before waiting for the product, but the probabilities ``P_c`` it carries
round the key-block loop must live in the registers the loop gives them, and those are the registers that the
product in flight is still reading. ptxas therefore waits for ``P_{c-1} V_{c-1}`` (``WARPGROUP.DEPBAR.LE gsb0,
0x0``) after the row maxima and before the first exponential: in SASS a consumer's softmax does not overlap its
own product, only the other consumer's. Here:

- **two key blocks per loop trip, two probability tiles**: the steps alternate between two loop values ``pa`` and
  ``pb``, the probabilities rounded to 16 bits after the product is waited for (FlashAttention-4's order); an odd
  step of a range runs alone before its pairs. ptxas still gives both tiles the same registers (and so still waits
  early) unless ``KEEP`` adds a use of the previous tile after the wait (:func:`_keep`): then step ``c`` writes
  ``P_c`` into registers that the product in flight does not read and the exponentials run while it runs, but the
  key-block loop spills (docs/kernel_notes.md); ``KEEP`` is off by default, a variant to time.
- with ``HW_SYNC`` (the default), the consumers' synchronisation as FlashAttention-3/4 have it: the turns of the
  ping-pong on hardware named barriers (``bar.sync`` / ``bar.arrive`` over the two warpgroups concerned, no
  shared-memory polling), and the K and V stages released by one arrival per warp (barriers counting
  ``4 * N_CONS``) right after that warp's ``wgmma`` wait; Gluon's ``mbarrier.arrive`` arrives from one thread
  behind a warpgroup-wide ``bar.sync``, three per step in :mod:`fwd`. Without ``HW_SYNC`` the kernel synchronises
  as :mod:`fwd` does (an A/B of the two ideas apart).

**Triton 3.6** (the GPU image's Triton; its Gluon has ``gl.inline_asm_elementwise`` but not ``gl.inline_asm``,
chosen at import by :data:`HAS_INLINE_ASM`):

- the named-barrier turns are the same ``bar.sync`` / ``bar.arrive`` (ids 8 and up), written as an elementwise asm
  with no operand and a dummy scalar result; the SASS has the same named barriers in the same places as on 3.9;
- ``HW_SYNC``'s per-warp release (:func:`_warp_arrive`) needs the mbarrier's shared address as an asm operand,
  which 3.6 cannot pass: there ``HW_SYNC`` releases with Gluon's ``mbarrier.arrive`` (one thread behind a
  warpgroup ``bar.sync``, as :mod:`fwd`), and ``THREAD_ARRIVE=True`` (either Triton) releases with one
  ``cp.async.mbarrier.arrive.noinc`` per thread instead (no warpgroup synchronisation; the barriers count
  ``128 * N_CONS``; compiled only, not yet run on a GPU);
- the odd step of a range keeps ``P_{c-1}`` alive through its wait (:data:`P_IN_DEPS`), without which ptxas
  serialises every wgmma on 3.6 (C7513), the mbarrier-turn variant included;
- ``KEEP`` is 3.9-only (its stores need a shared address as an asm operand): on 3.6 it stops at a
  ``static_assert``;
- more spills (compile-only, bytes stored, 3.6 / 3.9): D=128 causal 16 / 52 (``HW_SYNC``), 84 / 200
  (``THREAD_ARRIVE``); non-causal about 250 / 0-140 for all three; D=64 causal about 1000-1060 / 650 with 52-60
  spill instructions in every loop trip of two steps (3.9: none) for ``HW_SYNC`` and the mbarrier turns, 56 / 572
  and 2 a trip with ``THREAD_ARRIVE``. 3.9's SASS is as it was before the 3.6 forms.

The loader partition and the softmax arithmetic are :mod:`fwd`'s own (``fwd._loader``, ``fwd._softmax``), so tiles,
their order, the barriers' phases and the rounding of every score are those of :mod:`fwd`: the outputs should be
identical to its outputs bit for bit (``tools/ab_gluon_forward.py`` checks this as well as the float64 reference).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier, warpgroup_mma, warpgroup_mma_wait

from longattn.backends.gluon import fwd

# Hardware named barriers of the ping-pong turns: ids TURN_BAR + consumer. Triton's warp specialisation takes ids
# 0 .. 1 + partitions (ptxas reports "used 4 barriers" for fwd.py's two consumers, 5 for three).
TURN_BAR = gl.constexpr(8)


# Triton 3.9's Gluon has gl.inline_asm (no result needed, shared-memory descriptors as operands); 3.6's, the GPU
# image's, has only gl.inline_asm_elementwise (tensors or scalars as operands, at least one result). The forms below
# are chosen here, at import, so that no jit function compiled names what its Triton lacks.
_HAS_INLINE_ASM = hasattr(gl, "inline_asm")
HAS_INLINE_ASM = gl.constexpr(_HAS_INLINE_ASM)
# Triton 3.6 gives P_c the virtual register of P_{c-1} in the odd step of a range (``if odd: pa = _pstep(pa)``:
# result and argument meet in one value) while P_{c-1} V_{c-1} is still in flight, and ptxas then serialises every
# wgmma of the kernel (C7513: a wait after each wgmma instruction). There the odd step's wait for that product names
# P_{c-1} among its deps, which keeps it alive until the product is done; the pairs have no such hazard. 3.9's PTX
# has none, and 3.9 is left as it was (with every step's wait naming P_{c-1}, 3.9 spills 368 bytes at D=128 causal
# against 52).
P_IN_DEPS = gl.constexpr(not _HAS_INLINE_ASM)


@gluon.constexpr_function
def _named_barrier_asm(op, bar_id, threads, result=False):
    return f"{op} {bar_id}, {threads};" + ("\nmov.u32 $0, 0;" if result else "")


if _HAS_INLINE_ASM:
    @gluon.jit
    def _named_barrier(OP: gl.constexpr, BAR_ID: gl.constexpr, THREADS: gl.constexpr):
        asm: gl.constexpr = _named_barrier_asm(OP, BAR_ID, THREADS)
        gl.inline_asm(asm, "", [], is_pure=False)
else:
    @gluon.jit
    def _named_barrier(OP: gl.constexpr, BAR_ID: gl.constexpr, THREADS: gl.constexpr):
        # Triton 3.6: the elementwise form on no operand gives one scalar result (a dummy, set to 0); not pure, so
        # it is neither removed nor moved across the wgmma and barrier instructions around it
        asm: gl.constexpr = _named_barrier_asm(OP, BAR_ID, THREADS, True)
        gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _turn_wait(HALF: gl.constexpr):
    """Wait for this consumer's turn to issue its products (its named barrier: itself and the previous
    consumer's ``bar.arrive``)."""
    _named_barrier("bar.sync", TURN_BAR + HALF, 256)


@gluon.jit
def _turn_pass(HALF: gl.constexpr, N_CONS: gl.constexpr):
    """Give the turn to the next consumer (arrive on its named barrier without waiting)."""
    _named_barrier("bar.arrive", TURN_BAR + (HALF + 1) % N_CONS, 256)


@gluon.jit
def _warp_arrive(bar):
    """One arrival per warp (its lane 0) on the mbarrier ``bar``, with no synchronisation across the warpgroup;
    the barrier counts four arrivals per consumer warpgroup. Triton 3.9 only (``bar``'s address as an operand of
    ``gl.inline_asm``; 3.6 has no way to pass it): never compiled on 3.6 (:func:`_release`)."""
    gl.inline_asm("{\n.reg .pred p;\n.reg .b32 lane;\nmov.u32 lane, %laneid;\nsetp.eq.u32 p, lane, 0;\n"
                  "@p mbarrier.arrive.shared::cta.b64 _, [$0];\n}", "r", [bar], is_pure=False)


@gluon.constexpr_function
def _releases(hw_sync, thread_arrive, has_inline_asm, n_cons):
    """Arrivals that free a K or V stage (:func:`_release`)."""
    if not hw_sync:
        return n_cons
    if thread_arrive:
        return 128 * n_cons
    return (4 if has_inline_asm else 1) * n_cons


@gluon.constexpr_function
def _keep_asm(outputs, inputs):
    values, never, where = inputs
    lines = ["{", ".reg .pred never;", f".reg .b32 w<{len(values) // 2}>;", f"setp.ne.s32 never, {never[0]}, 0;",
             "@!never bra.uni keep_done;"]
    lines += [f"mov.b32 w{i}, {{{values[2 * i]}, {values[2 * i + 1]}}};" for i in range(len(values) // 2)]
    lines += [f"st.shared.v4.b32 [{where[0]}+{16 * i}], {{w{4 * i}, w{4 * i + 1}, w{4 * i + 2}, w{4 * i + 3}}};"
              for i in range(len(values) // 8)]
    return "\n".join(lines + ["keep_done:", "}"])


@gluon.jit
def _keep(p16, never, slot):
    """A use of the 16-bit probabilities ``p16`` that ptxas must keep (shared-memory stores under a predicate it
    cannot know false; ``never`` is 0 at run time), placed after the wait for the product that reads them: the
    registers of ``p16`` then stay its own until that wait, and the next probabilities go elsewhere. Triton 3.9
    only (the stores need ``slot``'s shared address as an operand, which 3.6's elementwise form cannot take)."""
    gl.static_assert(HAS_INLINE_ASM, "KEEP needs gl.inline_asm (Triton 3.9's Gluon; 3.6 has none)")
    gl.inline_asm(_keep_asm, ("h", "r", "r"), [p16, never, slot], is_pure=False)


@gluon.jit
def _release(bar, HW_SYNC: gl.constexpr, THREAD_ARRIVE: gl.constexpr):
    """Free a K or V stage after this warpgroup's wgmma wait. ``HW_SYNC``: on Triton 3.9 one arrival per warp
    (:func:`_warp_arrive`); on 3.6 Gluon's arrive (one thread behind a warpgroup ``bar.sync``, as :mod:`fwd`).
    ``THREAD_ARRIVE`` (with ``HW_SYNC``, either Triton): one arrival per thread and no synchronisation across the
    warpgroup (``cp.async.mbarrier.arrive.noinc``: ``ARRIVES.LDGSTSBAR`` in SASS, one instruction a warp; what it
    waits for, the thread's earlier ``cp.async`` copies, is nothing here). Without ``HW_SYNC`` :mod:`fwd`'s arrive.
    The barriers count :func:`_releases` arrivals."""
    if HW_SYNC and THREAD_ARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    elif HW_SYNC and HAS_INLINE_ASM:
        _warp_arrive(bar)
    else:
        mbarrier.arrive(bar, count=1)


@gluon.jit
def _pstep(acc, m_i, l_i, p_prev, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, never, slot, c, g,
           start_n, rows, n_k, shift, left, right, qk_scale, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
           P_LAYOUT: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
           MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HALF: gl.constexpr,
           N_CONS: gl.constexpr, HEAD_D: gl.constexpr, HW_SYNC: gl.constexpr, KEEP: gl.constexpr,
           THREAD_ARRIVE: gl.constexpr, P_DEP: gl.constexpr):
    """Key block ``c`` (the program's count) with ``P_{c-1} V_{c-1}`` in flight, as ``fwd._step``, but the
    probabilities are rounded after the product is waited for and returned as a new value (the caller alternates
    two). ``g``: this step's number in the program's ping-pong. ``P_DEP``: the wait for ``P_{c-1} V_{c-1}`` keeps
    ``P_{c-1}`` alive (:data:`P_IN_DEPS`)."""
    st = c % STAGES
    prev = (c - 1) % STAGES
    mbarrier.wait(k_ready.index(st), (c // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
    if HW_SYNC:
        _turn_wait(HALF)
    else:
        mbarrier.wait(turn.index(HALF), (g & 1) ^ (1 if HALF == 0 else 0))
    s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                      gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_smem.index(prev).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
    if HW_SYNC:
        _turn_pass(HALF, N_CONS)
    else:
        mbarrier.arrive(turn.index((HALF + 1) % N_CONS), count=1)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    _release(k_empty.index(st), HW_SYNC, THREAD_ARRIVE)
    p, m_i, l_i, alpha = fwd._softmax(s, m_i, l_i, start_n, rows, n_k, shift, left, right, qk_scale, (0.0, 0.0, 0),
                                      S_LAYOUT, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, False, False, 0)
    p16 = gl.convert_layout(p.to(v_smem.dtype), P_LAYOUT)
    if P_DEP:  # Triton 3.6: P_{c-1} stays alive (its registers its own) until its product is waited for
        acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if KEEP:
        _keep(p_prev, never, slot)
    _release(v_empty.index(prev), HW_SYNC, THREAD_ARRIVE)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    return acc, m_i, l_i, p16


@gluon.jit
def _blocks(acc, m_i, l_i, pa, first, end, lo, c0, g, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
            never, slot, rows, n_k, shift, left, right, qk_scale, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
            P_LAYOUT: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HALF: gl.constexpr,
            N_CONS: gl.constexpr, HEAD_D: gl.constexpr, HW_SYNC: gl.constexpr, KEEP: gl.constexpr,
            THREAD_ARRIVE: gl.constexpr):
    """Key blocks ``first .. end - 1`` of the tile whose first block is ``lo`` (``pa``: the probabilities of block
    ``first - 1``): an odd block alone, then pairs, the first of a pair writing ``pb`` while the product in flight
    reads ``pa`` and the second the other way round. Returns the statistics, ``O`` and the last block's ``P``."""
    blk = first
    if (gl.maximum(end - first, 0) % 2) == 1:
        acc, m_i, l_i, pa = _pstep(acc, m_i, l_i, pa, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                   never, slot, c0 + blk - lo, g + blk - lo - 1, blk * BLOCK_N, rows, n_k, shift,
                                   left, right,
                                   qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M, BLOCK_N, STAGES, MASKED, HAS_LEFT,
                                   HAS_RIGHT, HALF, N_CONS, HEAD_D, HW_SYNC, KEEP, THREAD_ARRIVE, P_IN_DEPS)
        blk = first + 1
    for b2 in range(blk, end, 2):
        acc, m_i, l_i, pb = _pstep(acc, m_i, l_i, pa, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                   never, slot, c0 + b2 - lo, g + b2 - lo - 1, b2 * BLOCK_N, rows, n_k, shift, left,
                                   right,
                                   qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M, BLOCK_N, STAGES, MASKED, HAS_LEFT,
                                   HAS_RIGHT, HALF, N_CONS, HEAD_D, HW_SYNC, KEEP, THREAD_ARRIVE, False)
        acc, m_i, l_i, pa = _pstep(acc, m_i, l_i, pb, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                   never, slot, c0 + b2 + 1 - lo, g + b2 - lo, (b2 + 1) * BLOCK_N, rows, n_k, shift,
                                   left, right,
                                   qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M, BLOCK_N, STAGES, MASKED, HAS_LEFT,
                                   HAS_RIGHT, HALF, N_CONS, HEAD_D, HW_SYNC, KEEP, THREAD_ARRIVE, False)
    return acc, m_i, l_i, pa


@gluon.jit
def _consumer(O, LSE, seq_q, seq_k, B, n_heads, left, right, scale, n_tiles_m, n_tiles, q_smem, k_smem, v_smem,
              tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, HALF: gl.constexpr,
              N_CONS: gl.constexpr, HEAD_D: gl.constexpr, SUB_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HW_SYNC: gl.constexpr,
              KEEP: gl.constexpr, THREAD_ARRIVE: gl.constexpr):
    """A consumer warpgroup: rows ``HALF * SUB_M`` on of every tile of the program (``fwd._consumer``'s tile loop
    for dense calls, its key-block loop in pairs)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    if HW_SYNC:
        if HALF == 0:  # consumer 0 takes the first turn: its barrier already holds its own arrival
            _named_barrier("bar.arrive", TURN_BAR, 256)
    never = (seq_q < 0).to(gl.int32)  # 0, which ptxas cannot know (see _keep)
    c0 = 0  # K/V blocks consumed before the current tile
    g = 0  # overlapped steps before the current tile (the turns' count)
    n = 0  # tiles before the current one
    mbarrier.wait(q_ready.index(0), 0)
    t = fwd._get(tile_slot, 0)
    while t < n_tiles:
        qb = n % 2
        b, h, m0, q0, n_q, k0, n_k = fwd._tile(t, n_tiles_m, n_heads, seq_q, seq_k, O, O, O, B, N_CONS * SUB_M,
                                               False)
        lo, full_lo, full_hi, hi = fwd._key_blocks(m0, n_q, n_k, left, right, N_CONS * SUB_M, BLOCK_N, HAS_LEFT,
                                                   HAS_RIGHT)
        shift = n_k - n_q
        row0 = m0 + HALF * SUB_M
        rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, S_LAYOUT))
        qk_scale = scale * fwd.LOG2E
        m_i = gl.full([SUB_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
        l_i = gl.zeros([SUB_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
        acc = gl.zeros([SUB_M, HEAD_D], gl.float32, O_LAYOUT)
        q = q_smem.index(N_CONS * qb + HALF).reshape([SUB_M, HEAD_D])
        if hi > lo:
            st = c0 % STAGES
            mbarrier.wait(k_ready.index(st), (c0 // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                              gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            _release(k_empty.index(st), HW_SYNC, THREAD_ARRIVE)
            p, m_i, l_i, alpha = fwd._softmax(s, m_i, l_i, lo * BLOCK_N, rows, n_k, shift, left, right, qk_scale,
                                              (0.0, 0.0, 0), S_LAYOUT, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, False,
                                              False, 0)
            pa = gl.convert_layout(p.to(v_smem.dtype), P_LAYOUT)
            if HAS_LEFT:  # blocks cut by the window's left edge
                acc, m_i, l_i, pa = _blocks(acc, m_i, l_i, pa, lo + 1, full_lo, lo, c0, g, q, k_smem, v_smem,
                                            k_ready, v_ready, k_empty, v_empty, turn, never, tile_slot, rows, n_k,
                                            shift,
                                            left, right, qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M, BLOCK_N,
                                            STAGES, True,
                                            HAS_LEFT, HAS_RIGHT, HALF, N_CONS, HEAD_D, HW_SYNC, KEEP, THREAD_ARRIVE)
            acc, m_i, l_i, pa = _blocks(acc, m_i, l_i, pa, gl.maximum(lo + 1, full_lo), full_hi, lo, c0, g, q,
                                        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, never, tile_slot,
                                        rows,
                                        n_k, shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M,
                                        BLOCK_N, STAGES,
                                        False, HAS_LEFT, HAS_RIGHT, HALF, N_CONS, HEAD_D, HW_SYNC, KEEP, THREAD_ARRIVE)
            acc, m_i, l_i, pa = _blocks(acc, m_i, l_i, pa, gl.maximum(lo + 1, full_hi), hi, lo, c0, g, q, k_smem,
                                        v_smem, k_ready, v_ready, k_empty, v_empty, turn, never, tile_slot, rows, n_k,
                                        shift, left, right, qk_scale, S_LAYOUT, O_LAYOUT, P_LAYOUT, SUB_M, BLOCK_N,
                                        STAGES, True,
                                        HAS_LEFT, HAS_RIGHT, HALF, N_CONS, HEAD_D, HW_SYNC, KEEP, THREAD_ARRIVE)
            last = c0 + hi - lo - 1
            mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
            acc = warpgroup_mma(pa, v_smem.index(last % STAGES).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(v_empty.index(last % STAGES), HW_SYNC, THREAD_ARRIVE)
            g += hi - lo - 1
        mbarrier.arrive(q_empty.index(qb), count=1)
        c0 += hi - lo
        n += 1

        seen = l_i != 0.0  # (a NaN sum: NaN output and lse, not a row without keys)
        l_safe = gl.where(seen, l_i, 1.0)
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) * fwd.LN2, float("-inf"))
        out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_LAYOUT))[:, None]
        o_rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, O_LAYOUT))
        d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_LAYOUT))
        bd = b.to(gl.int64)
        o_ptrs = O + ((bd * seq_q + o_rows[:, None].to(gl.int64)) * n_heads + h) * HEAD_D + d[None, :]
        gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(o_rows < n_q)[:, None])
        gl.store(LSE + (bd * n_heads + h) * seq_q + rows, lse, mask=rows < n_q)
        mbarrier.wait(q_ready.index(n % 2), (n // 2) & 1)
        t = fwd._get(tile_slot, (n % 2) * fwd.SLOT)


@gluon.jit
def flash_fwd_pingpong(Q, K, V, O, LSE, COUNTER, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, seq_q, seq_k, B,
                       n_heads, group, scale, left, right, HEAD_D: gl.constexpr, SUB_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                       HAS_RIGHT: gl.constexpr, CONSUMER_REGS: gl.constexpr, N_CONS: gl.constexpr = 2,
                       HW_SYNC: gl.constexpr = True, KEEP: gl.constexpr = False,
                       THREAD_ARRIVE: gl.constexpr = False):
    """Grid: (programs,), at most one per SM; ``num_warps`` 4 (the loader, ``fwd._loader``); ``N_CONS`` (2 or 3)
    consumers of four warps with ``CONSUMER_REGS`` registers. Dense calls only: q ``(B, seq_q, n_heads, D)``, k and v
    ``(B, seq_k, n_heads // group, D)`` (strides ``s?b, s?n, s?h``, unit stride along D), O contiguous
    ``(B, seq_q, n_heads, D)``, LSE float32 ``(B, n_heads, seq_q)``; ``COUNTER`` one int32 zero (tiles claimed).
    ``HW_SYNC``, ``KEEP`` (Triton 3.9 only), ``THREAD_ARRIVE``: the module's docstring and :func:`_release`."""
    n_tiles_m = gl.cdiv(seq_q, N_CONS * SUB_M)
    n_tiles = n_tiles_m * B * n_heads
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2 * N_CONS, 1, 1, SUB_M, HEAD_D], fwd.BOX16)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], fwd.BOX16)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], fwd.BOX16)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_slot = gl.allocate_shared_memory(gl.int32, [2 * fwd.SLOT, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    turn = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    RELEASES: gl.constexpr = _releases(HW_SYNC, THREAD_ARRIVE, HAS_INLINE_ASM, N_CONS)  # arrivals freeing a stage
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=N_CONS)
    for i in gl.static_range(N_CONS):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=RELEASES)
        mbarrier.init(v_empty.index(i), count=RELEASES)

    c0: gl.constexpr = 0
    c1: gl.constexpr = 1
    c2: gl.constexpr = 2
    four: gl.constexpr = 4  # the loader's warps (fwd._loader's LOADER_WARPS)
    # fwd._loader's packed-batch and float8 arguments are not read with VARLEN and FP8 off: LSE stands in.
    if N_CONS == 3:
        gl.warp_specialize([
            (fwd._loader, (Q, K, V, COUNTER, LSE, LSE, LSE, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svh, seq_q,
                           seq_k, B, B, n_heads, group, left, right, n_tiles_m, n_tiles, q_smem, k_smem, v_smem,
                           tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, HEAD_D, SUB_M, BLOCK_N,
                           STAGES, HAS_LEFT, HAS_RIGHT, False, False, N_CONS, four)),
            (_consumer, (O, LSE, seq_q, seq_k, B, n_heads, left, right, scale, n_tiles_m, n_tiles, q_smem, k_smem,
                         v_smem, tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, c0, N_CONS,
                         HEAD_D, SUB_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HW_SYNC, KEEP, THREAD_ARRIVE)),
            (_consumer, (O, LSE, seq_q, seq_k, B, n_heads, left, right, scale, n_tiles_m, n_tiles, q_smem, k_smem,
                         v_smem, tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, c1, N_CONS,
                         HEAD_D, SUB_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HW_SYNC, KEEP, THREAD_ARRIVE)),
            (_consumer, (O, LSE, seq_q, seq_k, B, n_heads, left, right, scale, n_tiles_m, n_tiles, q_smem, k_smem,
                         v_smem, tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, c2, N_CONS,
                         HEAD_D, SUB_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HW_SYNC, KEEP, THREAD_ARRIVE)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (fwd._loader, (Q, K, V, COUNTER, LSE, LSE, LSE, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, svh, seq_q,
                           seq_k, B, B, n_heads, group, left, right, n_tiles_m, n_tiles, q_smem, k_smem, v_smem,
                           tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, HEAD_D, SUB_M, BLOCK_N,
                           STAGES, HAS_LEFT, HAS_RIGHT, False, False, N_CONS, four)),
            (_consumer, (O, LSE, seq_q, seq_k, B, n_heads, left, right, scale, n_tiles_m, n_tiles, q_smem, k_smem,
                         v_smem, tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, c0, N_CONS,
                         HEAD_D, SUB_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HW_SYNC, KEEP, THREAD_ARRIVE)),
            (_consumer, (O, LSE, seq_q, seq_k, B, n_heads, left, right, scale, n_tiles_m, n_tiles, q_smem, k_smem,
                         v_smem, tile_slot, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, c1, N_CONS,
                         HEAD_D, SUB_M, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HW_SYNC, KEEP, THREAD_ARRIVE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
