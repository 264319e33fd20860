"""The Gluon Hopper forward (longattn/backends/gluon/fwd.py) compiled for sm_90a without a GPU, as the fused
backward is in test_gluon_bwd_fused_compile.py: ptxas reports no ignored ``setmaxnreg`` (C7507/C7508) and no
serialised ``wgmma`` (C7510/C7512), the loader gives its registers up and both consumers raise theirs
(``USETMAXREG``), spills stay under a stated bound and shared memory fits an H100; with ``fold_mask`` (D=64, 128) the
masked key-block loop multiplies no more than the unmasked one. Each case compiles in a process of its own
(tests/_sm90.py). A Triton whose Gluon moved under the same names shows here rather than on a user's
GPU."""
import json
import re

import pytest
from _sm90 import compile_in_process

from longattn.backends.gluon import launch

# Spill bytes measured (compile-only, sm_90a): none for the plain, packed and float8 kernels but D=128 causal 16
# (Triton 3.9.0, since P is packed by one cvt, per tile: none in the key-block loops; 32 with the one-warp loader,
# below); soft-capping 16 (3.9.0);
# ALiBi's split form (causal calls) 188 (3.6.0) / 252 (3.9.0), measured faster on an H100 than the absolute form
# (``alibi_abs``, non-causal calls: 12 B causal with 3.6.0, 76 B non-causal with 3.9.0); D=64's three consumers at 160
# registers 560 (3.9.0), all outside the key-block loop (408 causal, 272 not, with the masked blocks folded,
# GluonTiles.fold_mask; 3.6.0: none); D=256 causal 4 (3.6.0) / 120 (3.9.0), packed 92, soft-capping
# 144 (tanh.approx 56), ALiBi 192 (3.9.0); D=64 soft-capping by tanh.approx 316 (3.9.0) (docs/kernel_notes.md).
# "block_sums": the row sums added at every key block (GluonTiles.row_parts=False; the routed tiles keep per-thread
# shares). "fp8": the path the launcher runs (launch.FP8_MODE: V's keys permuted, none measured causal or not with
# 3.9.0; "fp8_window": with a sliding window, masked blocks on both sides, none with 3.6.0 or 3.9.0; the same at D=64,
# whose float8 rows of 64 bytes take the 64-byte swizzle, fwd.box_layout; D=256, with 128-key stages, 12-28 bytes
# with 3.6.0 and 120-256 with 3.9.0, outside the key-block loops, which the test checks; D=128's band-free call, on
# 256-key stages with GluonTiles.pv_wait_before_qk (launch.fp8_tiles), none with 3.6.0 and 56 with 3.9.0, outside
# the loops too; its causal and windowed calls, on 128-key stages with the one-warp loader, none). D=128's one-warp
# loader (GluonTiles.loader_warps) raised 3.9.0's causal spills to 32, soft-capping's to 32 and the absolute ALiBi
# form's to 364 (3.6.0: 0, 0 and 68). D=64's band-free and long causal float8 tiles (three consumers at 160
# registers): 4-28 B (3.6.0) / 220-536 B (3.9.0), outside the loops as the bf16 D=64 kernel's. The bound catches a
# change that adds real spills. Packed batches on the other schedules (GluonTiles.packed_schedule: "varlen_prefetch" 1,
# "varlen_grid" 2): none at D=128, causal or not (3.9.0). The output stored by TMA (GluonTiles.tma_store, routed at
# D=64 and 128, so in every dense 16-bit row there; "tma_store" alone: one head): none at D=128 with 3.6.0; with 3.9.0
# 60-88 B (tid-derived values kept across setmaxnreg, one reload a masked key block, none in unmasked ones), raising
# D=128's causal row from 32 to 64, soft-capping's to 68-72, the ALiBi forms' to 764 and 456 (from 364-512).
SPILL_BOUND = {(128, ""): 64, (128, "varlen"): 0, (128, "tma_store"): 96,
               (128, "varlen_prefetch"): 0, (128, "varlen_grid"): 0,
               (256, "varlen_prefetch"): 256, (128, "fp8"): 128, (128, "fp8_window"): 0, (64, "fp8"): 1024,
               (64, "fp8_window"): 0, (64, "fp8_long"): 1024, (64, "short_band"): 0, (64, "short_band_softcap_tanh"): 0,
               (256, "fp8"): 256, (256, "fp8_window"): 256,
               (128, "softcap"): 80,
               (128, "softcap_tanh"): 80, (128, "alibi"): 800, (128, "alibi_abs"): 480, (64, ""): 512,
               (64, "softcap_tanh"): 1024, (256, ""): 256, (256, "varlen"): 256, (256, "softcap"): 384,
               (256, "softcap_tanh"): 384, (256, "alibi"): 384, (64, "block_sums"): 1024, (128, "block_sums"): 64}
SHARED_LIMIT = 227 * 1024  # an H100's shared memory per block

_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from longattn.backends.gluon import fwd, launch
D, CAUSAL, MODS = json.loads(sys.argv[1])
FP8 = MODS.startswith("fp8")
WINDOW = MODS == "fp8_window"
sig = {n: "*fp8e4nv" if FP8 else "*bf16" for n in "Q K V".split()}
sig.update(O="*bf16", LSE="*fp32", COUNTER="*i32", DESCALE="*fp32", CU_Q="*i32", CU_K="*i32", CUM="*i32",
           SLOPES="*fp32", scale="fp32", softcap="fp32")
names = "sqb sqn sqh skb skn skh svb svn svh svd seq_q seq_k B n_seqs n_heads group left right alibi_offset"
sig.update({n: "i32" for n in names.split()})
t = (launch.fp8_tiles(D, CAUSAL or WINDOW, 1 << 20 if MODS == "fp8_long" else 0) if FP8
     else launch.band_tiles(D, 1 if MODS.startswith("short_band") else 0))
const = dict(HEAD_D=D, SUB_M=t.sub_m, BLOCK_N=t.block_n, STAGES=t.stages, HAS_LEFT=WINDOW,
             HAS_RIGHT=CAUSAL or WINDOW,
             CONSUMER_REGS=t.consumer_regs, FP8=launch.FP8_MODE if FP8 else 0, VARLEN=MODS.startswith("varlen"),
             PACKED_SCHED={"varlen_prefetch": 1, "varlen_grid": 2}.get(MODS, 0),
             SOFTCAP={"softcap": 1, "softcap_tanh": 2, "short_band_softcap_tanh": 2}.get(MODS, 0),
             ALIBI={"alibi": 2, "alibi_abs": 1}.get(MODS, 0),
             N_CONS=t.consumers, ROW_PARTS=t.row_parts and MODS != "block_sums", LOADER_WARPS=t.loader_warps,
             FOLD_MASK=t.fold_mask, PV_WAIT=t.pv_wait_before_qk, EXP2_FMA=t.fma_exp2 if FP8 else 0,
             O_TMA=(t.tma_store or MODS == "tma_store") and not FP8 and not MODS.startswith("varlen"))
if MODS == "tma_store":  # one head: Triton passes an integer argument equal to 1 as a constant
    const.update(n_heads=1, group=1)
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(GluonASTSource(fwd.flash_fwd, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
import re
print("MIN_REDUCTIONS", len(re.findall(r"arith[.]min(?:num|imum)f", kernel.asm["ttgir"])))
# The key-block loops (one step's wgmma: S = Q K^T and P V), with their FMULs and whether they mask: an FSEL a
# score (a tile's share of a thread: dozens), where an unmasked loop has a few a row (the row maxima's -inf guard).
k = 32 if FP8 else 16
loops = [dict(masked=sum("FSEL" in y for y in body) > 16, fsel=sum("FSEL" in y for y in body),
              fmul=sum(" FMUL" in " " + y for y in body),
              local=sum(bool(re.search(r"\\b(?:LDL|STL)\\b", y)) for y in body),
              mufu=sum("MUFU.EX2" in y for y in body), nan_max=sum("FMNMX.FTZ.NAN" in y for y in body),
              wait_one=sum("DEPBAR.LE gsb0, 0x1" in y for y in body))
         for body in loop_bodies(sass_of(kernel), D // k + t.block_n // k)]
print("LOOPS " + json.dumps(loops))
# The loader's tile set-up: 5-D (ragged) TMA loads, descriptors made on the device, the claim's atomic and its fence.
sass = sass_of(kernel)
print("LOADER " + json.dumps({name: len(re.findall(pattern, sass)) for name, pattern in (
    ("ragged_loads", r"UTMALDG[.]5D"), ("descriptors", r"UTMACCTL[.]IV"), ("claims", r"ATOMG[.]E[.]ADD"),
    ("gpu_fences", r"MEMBAR[.]ALL[.]GPU"))}))
# The consumers' global stores (the output's and the log-sum-exp's) and TMA stores.
print("STORES " + json.dumps({name: len(re.findall(pattern, sass)) for name, pattern in (
    ("stg", r"\\bSTG[.]"), ("tma", r"\\bUTMASTG[.]"))}))
"""


@pytest.mark.parametrize("d, causal, mods", [(128, True, ""), (128, False, "varlen"), (128, True, "fp8"),
                                             (128, False, "fp8"), (128, False, "fp8_window"), (64, True, "fp8"),
                                             (64, False, "fp8"), (64, False, "fp8_window"), (64, True, "fp8_long"),
                                             (256, True, "fp8"),
                                             (256, False, "fp8_window"), (128, True, "softcap"),
                                             (128, True, "softcap_tanh"), (128, True, "alibi"),
                                             (128, False, "alibi_abs"),
                                             (64, True, ""), (64, False, ""), (64, False, "softcap_tanh"),
                                             (256, True, ""),
                                             (256, False, "varlen"), (256, True, "softcap"),
                                             (256, True, "softcap_tanh"), (256, True, "alibi"),
                                             (64, False, "block_sums"), (128, True, "block_sums"),
                                             (128, False, "varlen_prefetch"), (128, True, "varlen_prefetch"),
                                             (128, True, "varlen_grid"),
                                             (256, True, "varlen_prefetch"), (128, True, "tma_store"),
                                             (64, True, "short_band"), (64, True, "short_band_softcap_tanh")])
def test_gluon_forward_register_budget_for_sm90(d, causal, mods, tmp_path):
    log, r = compile_in_process(_COMPILE, [d, causal, mods], tmp_path)
    for code in ("C7507", "C7508", "C7510", "C7512", "C7513", "C7514", "C7515"):
        assert code not in log, log
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= SPILL_BOUND[d, mods], log
    # The loader gives up its registers (24 or 32), the consumers raise theirs (2 x 240 or 3 x 160).
    long_rows = 1 << 20 if mods == "fp8_long" else 0  # (a causal call long enough for FP8_LONG_CAUSAL_TILES)
    t = (launch.fp8_tiles(d, causal or mods == "fp8_window", long_rows) if mods.startswith("fp8")
         else launch.band_tiles(d, 1 if mods.startswith("short_band") else 0))  # SHORT_BAND_TILES
    assert min(int(x, 16) for x in r["setmaxnreg"]) <= 32, r
    assert r["setmaxnreg"].count(hex(t.consumer_regs)) >= t.consumers, r
    assert r["shared"] <= SHARED_LIMIT and r["wgmma"] > 0, r
    # Float8's unmasked key blocks take the row maxima of the unscaled scores, or the minima where the descaled
    # scale is negative (fwd._softmax, NEG): a min reduction a consumer; none elsewhere.
    min_reductions = int(re.search(r"MIN_REDUCTIONS (\d+)", log).group(1))
    assert min_reductions == (t.consumers if mods.startswith("fp8") else 0), min_reductions
    # fold_mask: masked key blocks scale and shift each score by one FMA, as the unmasked ones (no FMUL a score more).
    loops = json.loads(log.split("LOOPS ", 1)[1].splitlines()[0])
    # Float8's spills (D=256's above all) stay outside the key-block loops: no local loads or stores a block. A block
    # waits for its scores with the previous P V still in flight (a wgmma wait that leaves one group outstanding),
    # or with GluonTiles.pv_wait_before_qk (D=128's 256-key tiles) for that P V before issuing Q K^T: no such wait.
    if mods.startswith("fp8"):
        assert loops and not any(x["local"] for x in loops), loops
        assert all(bool(x["wait_one"]) != t.pv_wait_before_qk for x in loops), loops
        # GluonTiles.fma_exp2: one exponential in fma_exp2 of an unmasked block by the polynomial (its clamp, a
        # NaN-keeping max, marks it), the rest and the two of the rescale on the special-function unit; masked blocks
        # all there.
        scores = t.sub_m * t.block_n // 128  # a thread's share of a key block
        for x in loops:
            poly = scores // t.fma_exp2 if t.fma_exp2 and not x["masked"] else 0
            assert (x["nan_max"], x["mufu"]) == (poly, scores + 2 - poly), (x, t)
    # Packed batches: the per-tile V descriptor (a call site per Q buffer) beside Q's and K's, and the claim with
    # its fence; with packed_schedule V through one ragged descriptor (5-D loads) made once, the claim relaxed (no
    # GPU-wide fence before it) or, one program a tile, no claim at all.
    loader = json.loads(log.split("LOADER ", 1)[1].splitlines()[0])
    if mods == "varlen":
        q_buffers = 2 if d * 2 <= 256 else 1  # (fwd.q_buffers of bf16 rows)
        assert loader["ragged_loads"] == 0 and loader["descriptors"] == 2 + q_buffers, loader
        assert loader["claims"] == 1 and loader["gpu_fences"] == 1, loader
    elif mods in ("varlen_prefetch", "varlen_grid"):
        one_grid = mods == "varlen_grid"
        assert loader["ragged_loads"] > 0 and loader["descriptors"] == 3, loader
        assert loader["claims"] == (0 if one_grid else 1) and loader["gpu_fences"] == 0, loader
    if t.fold_mask and not mods:
        masked = {x["fmul"] for x in loops if x["masked"]}
        assert masked and masked == {x["fmul"] for x in loops if not x["masked"]}, loops
    # GluonTiles.tma_store: each consumer stores its output rows from the Q buffer by TMA; the global stores left are
    # the log-sum-exp's (two rows a thread), none of the output's (plain: 64 a thread at D=128). The unmasked
    # key-block loops touch no local memory (the spills above, Triton 3.9.0's, reload one value a masked block).
    # The launcher passes O_TMA for dense 16-bit calls on tiles with the flag (routed at D=64 and 128).
    stores = json.loads(log.split("STORES ", 1)[1].splitlines()[0])
    if (t.tma_store or mods == "tma_store") and not mods.startswith(("fp8", "varlen")):
        assert stores["tma"] >= t.consumers and stores["stg"] <= 2 * t.consumers, stores
    if mods == "tma_store":
        assert not any(x["local"] for x in loops if not x["masked"]), loops
    elif not t.tma_store or mods.startswith(("fp8", "varlen")):
        assert stores["tma"] == 0, stores
