"""Rules of the repository that a test can hold."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*\$ (.+)$", section, flags=re.M)


def test_readme_quick_start_has_exactly_two_commands():
    assert len(quick_start_commands()) == 2


def test_ci_runs_the_readme_test_command():
    test_command = quick_start_commands()[1]
    assert "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, "the last command of .ci/run must be the README's test command"
    assert ci[-1] == test_command


def test_ci_tests_the_oldest_transformers_the_hf_extra_admits():
    pyproject = (ROOT / "pyproject.toml").read_text()
    lower = re.search(r'hf = \["transformers>=([0-9.]+)', pyproject).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    pinned = re.search(r'"transformers==([0-9.]+)"', ci).group(1)
    assert pinned.split(".")[:2] == lower.split(".")[:2], (pinned, lower)
