"""The Triton kernels' shared memory for block lists whose blocks are wider than the kernels' tiles, compiled for
sm_90 without a GPU (Triton's wheel carries the compiler): an H100's 227 KB per block must hold. Block lists of
64 x 256 at D=128 made the forward unroll two 128-key tiles with their buffers, 282 KB, and the launch failed with
``OutOfResources`` on the GPU; the list loops now unroll a listed block's tiles only up to ``UNROLL_ELEMS``."""
import json
import os
import subprocess
import sys

import pytest

SHARED_LIMIT = 227 * 1024

_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longattn.backends.triton import bwd, fwd
from longattn.backends.triton.tiles import TABLE, fit_tiles
kernel_name, d, lm, ln = json.loads(sys.argv[1])
fn = {"fwd": fwd._flash_fwd, "dkdv": bwd._flash_bwd_dkdv, "dq": bwd._flash_bwd_dq}[kernel_name]
bound = 64 if d <= 64 else 128 if d <= 128 else 256
t = TABLE.get(("sm90", kernel_name, bound, "list", "*")) or TABLE[("sm90", kernel_name, bound, "*", "*")]
t = fit_tiles(t, lm, ln)
const = dict(HEAD_D=d, BLOCK_D=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_LEFT=False, HAS_RIGHT=False,
             USE_LIST=True, PER_HEAD_OFFSET=False, LIST_M=lm, LIST_N=ln, VARLEN=False, TMA=True, SOFTCAP=False,
             ALIBI=False)
if kernel_name == "fwd":
    const.update(MERGE=False, FP8=False, V_TMA=False)
else:
    const.update(ACCUMULATE=False, PAIRED=False)
    if kernel_name == "dkdv":
        const.update(N_CLASSES=1, ONE_HEAD=True)
const = {n: v for n, v in const.items() if n in fn.arg_names}
ptrs = {**{n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")},
        **{n: "*fp32" for n in ("LSE", "DELTA", "STATS", "DESCALE", "SLOPES")},
        **{n: "*i32" for n in ("Q_NUM", "Q_IDX", "KV_NUM", "KV_IDX", "CU_Q", "CU_K")}}
sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("scale", "softcap") else "i32")
       for n in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 128),
                   options={"num_warps": t.num_warps, "num_stages": t.num_stages})
print("RESULT " + json.dumps(dict(shared=k.metadata.shared)))
"""


@pytest.mark.parametrize("kernel, d, lm, ln", [
    ("fwd", 128, 64, 256),  # 282 KB before the cap
    ("fwd", 256, 128, 128),  # the default block at D=256
    ("dkdv", 64, 512, 512), ("dq", 64, 512, 512),  # 16 and 8 tiles a listed block at D=64
])
def test_block_list_kernels_fit_an_h100s_shared_memory(kernel, d, lm, ln, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([kernel, d, lm, ln])], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])["shared"]
    assert shared <= SHARED_LIMIT, (kernel, d, lm, ln, shared)
