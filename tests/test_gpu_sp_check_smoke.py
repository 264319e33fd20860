"""``tools/gpu_sp_check.py`` (the 2-GPU sequence-parallel check, outside the package) runs in its CPU smoke mode:
two gloo processes, tiny sizes, every case passing and the summary tables printed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = {"ring zigzag causal softcap+alibi+sinks": 1, "ring packed balanced causal sinks": 1, "ulysses causal": 1,
         "hybrid ring 2 x ulysses 1": 1, "hybrid ring 1 x ulysses 2": 1, "ring deterministic=True": 2}


def test_gpu_sp_check_cpu_smoke_passes_and_prints_the_tables():
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "tools/gpu_sp_check.py", "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    correctness = out[out.index("== summary: correctness"):out.index("== summary: context-parallel training")]
    for case, count in CASES.items():
        rows = [line for line in correctness.splitlines() if line.startswith(f"| {case}")]
        assert len(rows) == count and all(r.rstrip().endswith("| OK     |") for r in rows), rows
    training = out[out.index("== summary: context-parallel training"):]
    for mode in ("ring (zigzag)", "ulysses (contiguous)"):
        assert any(line.startswith(f"| CP {mode}, 64 tokens") and "| OK     |" in line
                   for line in training.splitlines()), mode
        assert f"CP {mode}, 64 tokens: 2 processes" in training and "efficiency" in training
    assert "FAIL" not in out and out.rstrip().splitlines()[-1].startswith("result: PASS")
