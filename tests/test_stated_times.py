"""Times the project states are measured ranges kept in one place, the README's "Measured times" table; the command
line's help, docs/cli.md and the examples point there instead of stating their own (which drifted apart: 47 s,
about 40 s and about a minute for the same command)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATION = re.compile(r"\b(about|in|takes?)\s+(a|an|\d+(\.\d+)?)\s*(s|sec|seconds?|min|minutes?|minute)\b|"
                      r"\(\d+(\.\d+)?\s*s\b|\d+\s*s on \d+ cores", re.IGNORECASE)


def _help_text() -> str:
    from longattn.cli import build_parser

    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._actions:
        for sub in getattr(action, "choices", None) or {}:
            texts.append(action.choices[sub].format_help())
    return "\n".join(texts)


def test_the_readme_has_one_table_of_measured_times():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("## Measured times") == 1
    table = readme.split("## Measured times", 1)[1].split("\n## ", 1)[0]
    for what in ("longattn bench --quick", "python -m pytest -q", "examples/hf_finetune_long.py",
                 "examples/train_longnet.py", "examples/generate_longnet.py"):
        assert what in table, what


def test_other_places_point_to_it_instead_of_stating_times():
    places = {"docs/cli.md": (ROOT / "docs" / "cli.md").read_text(), "longattn bench --help": _help_text()}
    for example in ("hf_finetune_long.py", "train_longnet.py"):
        places[f"examples/{example}"] = (ROOT / "examples" / example).read_text().split('"""')[1]
    for name, text in places.items():
        assert not DURATION.search(text), (name, DURATION.search(text).group(0))
        assert "Measured times" in text, name


def test_code_and_tests_name_their_subject_not_an_issue_number():
    """A docstring or comment says what it is about ("deterministic=True", "packed batches balanced across
    ranks"), not which issue asked for it: the number means nothing to a reader of the code."""
    issue = re.compile(r"\bissue #?\d+", re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("longattn", "tests", "tools", "benchmarks", "examples")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if issue.search(line)]
    assert not found, found


def test_the_slow_marker_names_modules_that_exist():
    """The quick subset (`-m "not slow"`) leaves out the modules conftest.py lists; a renamed module must not
    silently fall back into the quick subset."""
    import os

    from conftest import SLOW_MODULES
    here = os.path.dirname(os.path.abspath(__file__))
    assert all(os.path.exists(os.path.join(here, name)) for name in SLOW_MODULES)
