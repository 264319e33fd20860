"""The GPU table scripts of ``benchmarks/`` (outside the installed package): each imports, answers ``--help``, says
how it is run, and shadows no module it could import; the CPU one runs as ``python benchmarks/<script>``."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _load(path: Path):
    """The script as a module (its ``main`` not run), under a name no other module has."""
    spec = importlib.util.spec_from_file_location(f"_benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_scripts_are_there():
    assert {p.stem for p in SCRIPTS} >= {f"bench_{name}" for name in (
        "flash", "dilated", "block_sparse", "varlen", "decode", "dilated_decode", "transformers", "fp8", "ring_drift")}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_says_how_to_run_it_and_answers_help(path, monkeypatch, capsys):
    module = _load(path)
    assert f"python benchmarks/{path.name}" in module.__doc__
    # run from the repository root, the script's folder comes first on sys.path: its name must hide no module
    found = importlib.util.find_spec(path.stem)  # (found in benchmarks/ itself where another test put it on sys.path)
    assert found is None or Path(found.origin).parent == path.parent, (
        f"benchmarks/{path.name} would shadow module {path.stem}")
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_ring_drift_runs_as_a_script_from_the_repository_root(tmp_path):
    out = tmp_path / "drift.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "benchmarks/bench_ring_drift.py", "--transport", "threads", "--worlds", "1,2",
                    "--tokens", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--backend", "torch",
                    "--out", str(out)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    table = out.read_text()
    assert table.startswith("ring drift: CPU (threads, backend torch)") and table.count("\n| 2 | ") == 3
