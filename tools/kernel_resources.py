"""Registers, spill stack and shared memory of the kernels for every entry of the Hopper tile table, compiled for
sm_90 with the installed Triton -- no GPU needed (Triton's wheel carries ptxas and cuobjdump).

    python tools/kernel_resources.py [--dims 64 128] [--passes fwd dkdv dq] [--tiles 64,128,8,3 ...]

(The kernels' integer arguments are compiled without the divisibility hints a launch gives them, so absolute
counts run a little higher than on the GPU; compare versions with the same script.)

A kernel that needs more than 255 registers per thread spills to a per-thread stack in local memory ("stack" > 0),
which costs memory traffic in the inner loop. Use this to see what a code change does to the kernels' resources
before spending GPU time on timing it; timings themselves come from the benchmark and tuning scripts.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longattn.backends.triton import bwd, fwd  # noqa: E402
from longattn.backends.triton.tiles import TABLE, Tiles  # noqa: E402

_POINTERS = {**{n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")},
             **{n: "*fp32" for n in ("LSE", "DELTA", "STATS", "DESCALE", "SLOPES")},
             **{n: "*i32" for n in ("Q_NUM", "Q_IDX", "KV_NUM", "KV_IDX", "CU_Q", "CU_K")}}


def resources(fn, constexprs: dict, tiles: Tiles) -> str:
    """``reg R stack S smem M`` of ``fn`` compiled for sm_90 with these constexprs and tiles."""
    sig = {name: "constexpr" if name in constexprs else _POINTERS.get(name, "fp32" if name in ("scale", "softcap") else "i32")
           for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 128),
                            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return f"reg {m.group(1):>3}  stack {m.group(2):>5} B  smem {kernel.metadata.shared:>6} B"


def constexprs(pass_name: str, d: int, banded: bool, t: Tiles, one_head: bool, listed: bool = False,
               tma: bool = False) -> dict:
    c = dict(HEAD_D=d, BLOCK_D=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_LEFT=False, HAS_RIGHT=banded,
             USE_LIST=listed, PER_HEAD_OFFSET=False, LIST_M=128 if listed else t.block_m,
             LIST_N=128 if listed else t.block_n)
    if "VARLEN" in fwd._flash_fwd.arg_names:
        c["VARLEN"] = False
    # the score modifications off (constexprs with defaults: left out, they would compile as integer arguments)
    c.update(SOFTCAP=False, ALIBI=0 if pass_name == "fwd" else False)
    if pass_name == "fwd":
        extra = {n: v for n, v in (("TMA", tma), ("FP8", False), ("V_TMA", False)) if n in fwd._flash_fwd.arg_names}
        return dict(c, MERGE=False, **extra)
    c["ACCUMULATE"] = False
    if "TMA" in fwd._flash_fwd.arg_names:
        c["TMA"] = tma
    if "PAIRED" in bwd._flash_bwd_dq.arg_names:
        c["PAIRED"] = False  # the row statistics as two planes (dense calls)
    if pass_name == "dkdv":
        c["N_CLASSES"] = 1
        if "ONE_HEAD" in bwd._flash_bwd_dkdv.arg_names:
            c["ONE_HEAD"] = one_head
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--passes", nargs="+", default=["fwd", "dkdv", "dq"])
    p.add_argument("--tiles", nargs="*", default=None, help="BLOCK_M,BLOCK_N,WARPS,STAGES instead of the table's")
    p.add_argument("--gqa", action="store_true", help="dK/dV programs that loop over several query heads")
    p.add_argument("--banded", action="store_true", help="with --tiles: compile with a causal band")
    p.add_argument("--listed", action="store_true", help="the block-list path (blocks of 128) instead of ranges")
    p.add_argument("--tma", action="store_true", help="K/V loads through tensor descriptors")
    a = p.parse_args()
    fns = {"fwd": fwd._flash_fwd, "dkdv": bwd._flash_bwd_dkdv, "dq": bwd._flash_bwd_dq}
    print(f"triton {triton.__version__}, sm_90", flush=True)
    for pass_name in a.passes:
        for (arch, name, bound, path, rows), t in TABLE.items():
            if arch != "sm90" or name != pass_name or bound not in a.dims:
                continue
            cases = ([(a.banded, Tiles(*map(int, spec.split(",")))) for spec in a.tiles] if a.tiles
                     else [(path in ("banded", "list+band"), t)])
            for banded, tiles in cases:
                listed = a.listed or path.startswith("list")
                r = resources(fns[pass_name], constexprs(pass_name, bound, banded, tiles, not a.gqa, listed, a.tma),
                              tiles)
                print(f"{pass_name:>4} D={bound:<3} {path:9} {rows:7} "
                      f"{tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}: {r}", flush=True)


if __name__ == "__main__":
    main()
