"""Compiling a Gluon kernel for sm_90a on a machine without a GPU, for the register-budget tests
(test_gluon_fwd_compile.py, test_gluon_bwd_fused_compile.py): Triton's wheel carries ptxas and cuobjdump.

A test's script builds ``kernel = triton.compile(...)`` and ends with :data:`REPORT`, which prints one ``RESULT``
line of what the SASS shows (the script may read the SASS itself through :data:`PRELUDE`'s helpers); :func:`compile_in_process` runs the script in a process of its own (the CPU tests run
under the Triton interpreter, which replaces Gluon's compiler) with a fresh cache, so ptxas runs and logs."""
import json
import os
import subprocess
import sys
from typing import Tuple

import pytest

# Before a test's script: ``sass_of(kernel)``, the compiled kernel's SASS text (cuobjdump of its cubin), and
# ``loop_bodies(sass, wgmma)``, the instructions of each loop (a backward branch, from its target to the branch) that
# holds exactly ``wgmma`` wgmma instructions (bf16 HGMMA, float8 QGMMA): a kernel's key-block loops.
PRELUDE = """
import os as _os, re as _re, subprocess as _subprocess, tempfile as _tempfile


def sass_of(kernel):
    tool = _os.path.join(_os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with _tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return _subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_bodies(sass, wgmma):
    ins = [(int(a, 16), x) for a, x in _re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+([^;]*);", sass)]
    bodies = []
    for a, x in ins:
        m = _re.search(r"BRA (0x[0-9a-f]+)", x)
        if m and int(m.group(1), 16) < a:
            body = [y for b, y in ins if int(m.group(1), 16) <= b <= a]
            if sum(bool(_re.search(r"\\b[HQ]GMMA\\.", y)) for y in body) == wgmma:
                bodies.append(body)
    return bodies
"""

# The end of a test's script: ``kernel`` compiled; prints the kernel's shared memory and, from its SASS, the
# setmaxnreg requests, the highest register, the TMA reduce-adds and the wgmma instructions (bf16 HGMMA, float8
# QGMMA).
REPORT = """
import json as _json
_sass = sass_of(kernel)
print("RESULT " + _json.dumps(dict(
    shared=kernel.metadata.shared,
    setmaxnreg=_re.findall(r"USETMAXREG\\.\\w+\\.CTAPOOL (?:UP\\d+, )?(0x[0-9a-f]+)", _sass),
    max_reg=max(int(r) for r in _re.findall(r"\\bR(\\d+)\\b", _sass)),
    reduce_add=len(_re.findall(r"UTMAREDG\\.\\w+\\.ADD", _sass)),
    wgmma=len(_re.findall(r"\\b[HQ]GMMA\\.", _sass)))))
"""


def compile_in_process(script: str, args, tmp_path) -> Tuple[str, dict]:
    """Run ``script`` (ending with :data:`REPORT`) with ``json.dumps(args)`` as its argument: ``(the ptxas log,
    the RESULT dict)``."""
    pytest.importorskip("triton.experimental.gluon._runtime")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=str(tmp_path))  # a fresh cache, so ptxas runs and logs
    # Run from tmp_path: the package imported is the installed one (or PYTHONPATH's), not the working directory's.
    done = subprocess.run([sys.executable, "-c", PRELUDE + script + REPORT, json.dumps(args)], env=env,
                          capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    log, result = done.stdout.split("RESULT ", 1)
    assert "ptxas" in log, "no ptxas log: TRITON_DUMP_PTXAS_LOG did not take effect"
    return log, json.loads(result.splitlines()[0])
