"""The fused Hopper backward (longattn/backends/gluon/bwd_fused.py) compiled for sm_90a without a GPU: Triton's
wheel carries ptxas and cuobjdump, so the register budget of the warp-specialised kernel is checked here, in CI.

What is checked (docs: ../shared/HOPPER_BACKWARD.md, section 1): ptxas reports no C7507/C7508 (``setmaxnreg``
ignored), C7510, C7512, C7515 or C7517 (``wgmma`` serialised), the SASS raises the consumers to 240 registers (``USETMAXREG``) and
uses registers past the kernel-level 168 (so the raise took effect), spills stay under a stated bound, shared memory
fits an H100, and dQ leaves through the TMA reduce-add (``UTMAREDG``); with ``DKV_TMA`` dK and dV leave by TMA stores
(``UTMASTG``), with no plain store (``STG``) left but a paired program's first key block's; with descriptors made
on the host (``HOST_DESC``) no program makes one (no ``ATOMG``). Each case compiles in a process of its own
(tests/_sm90.py)."""
import json
import re

import pytest
from _sm90 import compile_in_process

# Spill bytes measured at D=128 (compile-only, sm_90a), with the row statistics in the accumulators (SPLIT_DQ):
# Triton 3.6.0 4 (non-causal) / 52 (causal, paired) / 192 (causal, one consumer's dQ), 3.9.0 0 / 88 / 160; with the
# packed batch, a window, soft-capping and ALiBi all at once 740 (3.6.0) / 456 (3.9.0); block lists 28 / 72; D=64
# spills nothing but 4 B with everything at once (3.6.0). The bound catches a change that adds real spills (docs/kernel_notes.md).
# D=256 (bwd_fused_wide.py) spills nothing, 40 with everything at once (3.9.0; 0 with 3.6.0).
SPILL_BOUND = {(128, ""): 256, (128, "varlen,window,softcap,alibi"): 768, (128, "lists"): 128, (64, ""): 0,
               (64, "varlen,window,softcap,alibi"): 16, (64, "lists"): 0, (256, ""): 0,
               (256, "varlen,window,softcap,alibi"): 128, (256, "lists"): 0, (128, "deterministic"): 256,
               (128, "window,deterministic"): 256, (64, "deterministic"): 0,
               # DKV_TMA (dK/dV by TMA stores): D=64 paired spills 40 B (3.9.0), values of the prologue that the
               # loader reloads; elsewhere the bound without it
               (64, "dkv_tma"): 64}
SHARED_LIMIT = 227 * 1024  # an H100's shared memory per block

_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from longattn.backends.gluon import bwd_fused, bwd_fused_wide
D, CAUSAL, SPLIT_DQ, PAIRED, MODS = json.loads(sys.argv[1])
sig = {n: "*bf16" for n in "Q K V DO DK DV".split()}
sig.update(STATS="*fp32", DQ="*fp32", SLOPES="*fp32", scale="fp32", softcap="fp32")
sig.update({n: "*i32" for n in "CU_Q CU_K WORK Q_NUM Q_IDX".split()})
names = "sqb sqn sqh skb skn skh svb svn svh sdb sdn sdh seq_q seq_k n_heads group n_batch n_pad n_work left right"
names += " list_sb list_sh list_w"
sig.update({n: "i32" for n in (names + " alibi_offset").split()})
block_m, sub_n = bwd_fused.TILES[D]
const = dict(HEAD_D=D, BLOCK_M=block_m, SUB_N=sub_n, HAS_LEFT="window" in MODS, HAS_RIGHT=CAUSAL, SPLIT_DQ=SPLIT_DQ,
             CONSUMER_REGS=bwd_fused.CONSUMER_REGS, PAIRED=PAIRED, VARLEN="varlen" in MODS, SOFTCAP="softcap" in MODS,
             ALIBI="alibi" in MODS, CAUSAL=CAUSAL and "window" not in MODS, USE_LIST="lists" in MODS,
             LIST_M=64 if D == 128 else 128, LIST_N=256 if D == 128 else 128)
kernel = bwd_fused.flash_bwd_fused
if D == 256:
    kernel = bwd_fused_wide.flash_bwd_fused_wide
else:
    sig["TURNS"] = "*i32"
    sig.update(DK_DESC="*bf16", DV_DESC="*bf16")  # (host descriptors' places: pointers, not read, without HOST_DESC)
    if "host_desc" in MODS:  # the descriptors' types, from host descriptors of small CPU tensors
        import torch
        q = torch.zeros(2, 256, 4, D, dtype=torch.bfloat16)
        descs = bwd_fused.host_descriptors_of(q, q, q, q, torch.zeros(16, 256), torch.zeros(2, 256, 4, D), q, q,
                                              "dkv_tma" in MODS)
        for name, d in zip("Q K V DO STATS DQ DK DV DK_DESC DV_DESC".split(), descs):
            if not isinstance(d, torch.Tensor):
                sig[name] = d.__mangle__() if hasattr(d, "__mangle__") else triton.runtime.jit.mangle_type(d)
    const["DETERMINISTIC"] = "deterministic" in MODS
    const["DKV_TMA"] = "dkv_tma" in MODS
    const["HOST_DESC"] = "host_desc" in MODS
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(GluonASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
_s = sass_of(kernel)
print("STORES " + json.dumps(dict(stg=len(_re.findall(r"\\bSTG\\.", _s)), tma=len(_re.findall(r"\\bUTMASTG\\b", _s)),
                                  atomg=len(_re.findall(r"\\bATOMG\\.", _s)))))
"""


@pytest.mark.parametrize("d, causal, split_dq, paired, mods", [
    (128, False, True, False, ""), (128, True, True, True, ""), (128, True, False, False, ""),
    (64, True, False, True, ""),
    (128, True, True, False, "varlen,window,softcap,alibi"),  # everything the kernel computes, at once
    (64, True, False, False, "varlen,window,softcap,alibi"),
    (128, True, True, False, "lists"), (64, False, False, False, "lists"),  # block-sparse
    (256, False, True, False, ""), (256, True, True, True, ""), (256, True, True, False, "varlen,window,softcap,alibi"),
    (256, True, True, False, "lists"),
    # dQ added in a fixed order (turn counters; the grid heads first)
    (128, False, True, False, "deterministic"), (128, True, True, False, "deterministic"),
    (128, True, True, False, "window,deterministic"), (64, True, False, False, "deterministic"),
    # dK and dV out by TMA stores (DKV_TMA; a paired program's first key block by plain stores)
    (128, False, True, False, "dkv_tma"), (128, True, True, True, "dkv_tma"), (64, True, False, True, "dkv_tma"),
    (128, True, True, False, "varlen,window,softcap,alibi,dkv_tma"),
    (128, False, True, False, "deterministic,dkv_tma"),
    # descriptors made on the host (not routed: the schedules' A/B)
    (128, True, True, True, "host_desc"), (128, False, True, False, "host_desc,dkv_tma"),
    (64, True, False, False, "host_desc"),
])
def test_fused_backward_register_budget_for_sm90(d, causal, split_dq, paired, mods, tmp_path):
    log, r = compile_in_process(_COMPILE, [d, causal, split_dq, paired, mods], tmp_path)
    for code in ("C7507", "C7508", "C7510", "C7512", "C7513", "C7515", "C7517"):
        assert code not in log, log
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    bound = SPILL_BOUND.get((d, mods), SPILL_BOUND[d, mods.replace("dkv_tma", "").replace("host_desc", "").strip(",")])
    assert spills and max(spills) <= bound, log
    # The loader gives its registers up (24 = 0x18) and both consumers ask for 240 (0xf0).
    assert "0x18" in r["setmaxnreg"] and r["setmaxnreg"].count("0xf0") >= 2, r
    if d >= 128:  # the consumers really use more than the kernel-level 168 (and no more than 240)
        assert 168 < r["max_reg"] < 240, r
    assert r["shared"] <= SHARED_LIMIT, r
    assert r["reduce_add"] >= 2 and r["wgmma"] > 0, r  # dQ through the TMA reduce-add, one per consumer
    stores = json.loads(re.search(r"STORES (.*)", log).group(1))
    if "dkv_tma" in mods:  # dK and dV of each consumer by TMA; plain stores only in a paired program's first block
        assert stores["tma"] >= 4 and (stores["stg"] == 0) != paired, stores
    else:
        assert stores["tma"] == 0 and stores["stg"] > 0, stores
    # Descriptors made on the device write their tensormaps with global atomic exchanges; host ones need none.
    assert (stores["atomg"] == 0) == ("host_desc" in mods), stores
