"""The unrouted ping-pong Gluon forward (longattn/backends/gluon/fwd_pingpong.py) compiled for sm_90a without a GPU,
as the routed forward is in test_gluon_fwd_compile.py: no ignored ``setmaxnreg`` (C7507/C7508), no serialised
``wgmma`` (C7510/C7512/C7513), the loader gives registers up and the consumers raise theirs, shared memory fits an
H100, spills stay under a bound and none falls inside the key-block loop (the loop trips of two steps), and the
turns of the ping-pong are hardware named barriers, two waits and two arrivals in every trip of two steps, beside
its four releases (per thread with ``THREAD_ARRIVE``). Each case compiles in a process of its own
(tests/_sm90.py), about 45 s in all (a window, D=64 without a mask and the mbarrier turns were compiled by hand:
docs/kernel_notes.md).

Written for Triton 3.9. With Triton 3.6 (the GPU image's; ``fwd_pingpong`` then takes its 3.6 forms) the same cases
compile and the checks of warnings, barriers, registers and shared memory hold, but the spill bounds do not: there
the spills (and those inside the loop) are only reported, in the ptxas log of a failing run, by hand."""
import json
import re

import pytest
from _sm90 import compile_in_process

from longattn.backends.gluon import launch

# Triton 3.9's Gluon (gl.inline_asm), for which the spill bounds below hold (see the module's docstring).
_TRITON_39 = hasattr(pytest.importorskip("triton.experimental.gluon.language"), "inline_asm")

# Spill bytes measured (compile-only, sm_90a, Triton 3.9.0; docs/kernel_notes.md, 2026-11-29): D=128 0 (causal 52,
# in the tile's prologue), D=64's three consumers at 160 registers 652-852 in the tiles' prologue and epilogue (the
# routed kernel: 560), 572 with one release per thread; none inside the key-block loop.
SPILL_BOUND = {128: 64, 64: 1024}
SHARED_LIMIT = 227 * 1024  # an H100's shared memory per block

_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from longattn.backends.gluon import fwd_pingpong, launch
D, CAUSAL, LEFT, HW_SYNC, THREAD_ARRIVE = json.loads(sys.argv[1])
sig = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*fp32", COUNTER="*i32", scale="fp32")
sig.update({n: "i32" for n in "sqb sqn sqh skb skn skh svb svn svh seq_q seq_k B n_heads group left right".split()})
t = launch.TILES[D]
const = dict(HEAD_D=D, SUB_M=t.sub_m, BLOCK_N=t.block_n, STAGES=t.stages, HAS_LEFT=LEFT, HAS_RIGHT=CAUSAL,
             CONSUMER_REGS=t.consumer_regs, N_CONS=t.consumers, HW_SYNC=HW_SYNC, KEEP=False,
             THREAD_ARRIVE=THREAD_ARRIVE)
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(GluonASTSource(fwd_pingpong.flash_fwd_pingpong, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
import re
sass = sass_of(kernel)
loops = []
for body in loop_bodies(sass, 2 * (D // 16 + t.block_n // 16)):  # wgmma instructions of two key-block steps
    loops.append(dict(spills=sum(("STL" in x or "LDL" in x) for x in body),
                      waits=sum(bool(re.search(r"BAR\\.SYNC\\.DEFER_BLOCKING 0x[89a],", x)) for x in body),
                      passes=sum(bool(re.search(r"BAR\\.ARV 0x[89a],", x)) for x in body),
                      thread_releases=sum("ARRIVES.LDGSTSBAR" in x for x in body),
                      releases=sum(bool(re.search(r"ARRIVES\\.LDGSTSBAR|SYNCS\\.ARRIVE", x)) for x in body)))
print("LOOPS " + json.dumps(dict(pair_loops=loops, named=len(re.findall(r"BAR\\.ARV 0x[89a]", sass)))))
"""


@pytest.mark.slow
@pytest.mark.parametrize("d, causal, left, hw_sync, thread_arrive", [  # (a research kernel: two cases in CI; the
    (128, True, False, True, False), (64, True, False, True, True)])   # others by hand, docs/kernel_notes.md)
def test_gluon_pingpong_forward_register_budget_for_sm90(d, causal, left, hw_sync, thread_arrive, tmp_path):
    log, r = compile_in_process(_COMPILE, [d, causal, left, hw_sync, thread_arrive], tmp_path)
    for code in ("C7507", "C7508", "C7510", "C7512", "C7513"):
        assert code not in log, log
    loops = json.loads(log.split("LOOPS ", 1)[1].splitlines()[0])
    assert loops["pair_loops"], loops  # the key-block loops found
    for trip in loops["pair_loops"]:  # two steps: each waits for its turn, passes it on and frees a K and a V stage
        assert (trip["waits"], trip["passes"]) == ((2, 2) if hw_sync else (0, 0)), loops
        assert trip["releases"] == (4 if hw_sync else 6), loops  # the mbarrier turns arrive as well
        assert trip["thread_releases"] == (4 if thread_arrive else 0), loops
    assert (loops["named"] > 0) == hw_sync, loops
    if _TRITON_39:
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
        assert spills and max(spills) <= SPILL_BOUND[d], log
        assert not any(trip["spills"] for trip in loops["pair_loops"]), loops  # no spill inside the loop
    t = launch.TILES[d]
    assert min(int(x, 16) for x in r["setmaxnreg"]) <= 32, r
    assert r["setmaxnreg"].count(hex(t.consumer_regs)) >= t.consumers, r
    assert r["shared"] <= SHARED_LIMIT and r["wgmma"] > 0, r
