"""The decode split kernel compiled for sm_90 without a GPU (Triton's wheel carries the compiler): how many K and V
tiles its loop keeps in flight. Where a tile's rows come from a block-table read inside the loop (paged caches),
Triton's pipeliner gives the table read a stage of its own and keeps (num_stages - 1) // 2 buffers of K and V, not
num_stages - 1: with the contiguous row's stages a paged cache's tile would wait for the previous tile's softmax.
The paged rows of ``decode_launch.DECODE_TILES`` must keep as many buffers as the contiguous rows they mirror."""
import json
import os
import subprocess
import sys

import pytest

SHARED_LIMIT = 227 * 1024

_COMPILE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longattn.backends.triton import decode_kernels as K
from longattn.backends.triton import decode_launch as D

fn = K._decode_split
ptrs = dict(Q="*bf16", KC="*bf16", VC="*bf16", OUT="*bf16", SEQLENS="*i32", BT="*i32", WS="*fp32", KD="*fp32",
            VD="*fp32", SLOPES="*fp32")
# the divisibility a launch gives 16-aligned pointers and the strides of a (pages, page, 8, 128) cache
aligned = set(ptrs) | {"sqb", "sqn", "sqh", "sckb", "sckn", "sckh", "scvb", "scvn", "scvh", "bt_sb", "page_size"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
results = []
for kind, page, *fields in json.loads(sys.argv[1]):
    t = D.DECODE_TILES[kind]
    const = dict(HEAD_D=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=t.block_n, HAS_LEFT=False, HAS_RIGHT=True,
                 PAGED=page > 0, PAGE_BLOCKS=page > 0 and page % t.block_n == 0, FP8_CACHE=False, SOFTCAP=False,
                 ALIBI=False, DIRECT=False, PAGE=D._page_constant(page > 0, page), TMA=t.tma and page == 0)
    const.update(*fields)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("scale", "softcap") else "i32")
           for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                       options={"num_warps": t.num_warps, "num_stages": t.num_stages})
    tiles = re.findall(r"memdesc<(\\d+)x%dx128xbf16" % t.block_n, k.asm["ttgir"])
    ptx = k.asm["ptx"]
    results.append(dict(buffers=max(map(int, tiles)), shared=k.metadata.shared,
                        tma=len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)),
                        cp_async=len(re.findall(r"cp\\.async\\.cg", ptx)),
                        ld_global=len(re.findall(r"ld\\.global\\.v4", ptx))))
print("RESULT " + json.dumps(results))
"""


def _compiled(cases, tmp_path) -> list:
    """``_COMPILE`` of ``cases`` (``(kind, page)`` pairs) in a process of its own with a fresh Triton cache: per case,
    the K and V buffers its loop keeps and its shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])


def test_paged_hopper_decode_keeps_as_many_tiles_in_flight_as_contiguous(tmp_path):
    """16-bit flash decode on sm_90 at D = 128: the paged row's loop holds as many K and V buffers as the
    contiguous row's (two), at page 16 (a tile spans pages: a table read per row) and page 256 (one table read a
    tile), within an H100's shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    from longattn.backends.triton import decode_launch as D

    cases = [(D.decode_kind(False, page > 0, False, 128, 2, "sm90", page), page) for page in (0, 16, 256)]
    assert [kind for kind, _ in cases] == ["sm90", "sm90_paged", "sm90_paged"]
    want, *got = _compiled(cases, tmp_path)
    assert want["buffers"] == 2, want
    for (kind, page), g in zip(cases[1:], got):
        assert g["buffers"] == want["buffers"], (kind, page, g, want)
        assert g["shared"] <= SHARED_LIMIT, (kind, page, g)


def test_the_rows_for_many_programs_keep_their_tiles_in_flight_and_fit_several_an_sm(tmp_path):
    """The sm_90 rows for calls of more programs than SMs (``decode_launch.MANY_PROGRAMS``) compile for sm_90 at
    D = 128 with at least two K and V buffers in flight, paged ones at page 16 and 256 too, and with the shared
    memory of the co-resident programs their rule assumes: three of the 64-key rows' ("sm90_many", "sm90_many_tma",
    "sm90_paged_many") in one SM's (a 64-key program's two buffers), more of the 32-key rows'."""
    pytest.importorskip("triton.backends.nvidia")
    from longattn.backends.triton import decode_launch as D

    cases = [("sm90_many", 0), ("sm90_many_tma", 0), ("sm90_most", 0)]
    cases += [(kind, page) for kind in ("sm90_paged_many", "sm90_paged_most") for page in (16, 256)]
    assert {many.kind for rows in D.MANY_PROGRAMS.values() for many in rows} == {kind for kind, _ in cases}
    for (kind, page), g in zip(cases, _compiled(cases, tmp_path)):
        assert g["buffers"] >= 2, (kind, page, g)
        assert 3 * g["shared"] <= SHARED_LIMIT, (kind, page, g)


def test_the_descriptor_row_compiles_for_sm90_with_tma_loads(tmp_path):
    """The 64-key row for slightly more programs than SMs ("sm90_many_tma") compiles for sm_90 with K and V by TMA
    (no ``cp.async``) and the two buffers of its pointer twin ("sm90_many"), in about its shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    base, tma = _compiled([("sm90_many", 0), ("sm90_many_tma", 0)], tmp_path)
    assert base["tma"] == 0 and base["cp_async"] > 0 and base["buffers"] == 2, base
    assert tma["tma"] > 0 and tma["cp_async"] == 0 and tma["buffers"] == 2, tma
    assert tma["shared"] <= base["shared"] + 64, (tma, base)
