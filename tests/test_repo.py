"""Rules of the repository that a test can hold."""

import re
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("package", ["transformers", "peft", "accelerate"])
def test_ci_tests_the_oldest_versions_the_hf_extra_admits(package):
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^hf = \[(.*)\]", pyproject, flags=re.M).group(1)
    lower = re.search(rf'"{package}>=([0-9.]+)', extra).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    pinned = re.search(rf'"{package}==([0-9.]+)"', ci).group(1)
    assert pinned.split(".")[:2] == lower.split(".")[:2], (package, pinned, lower)


def test_readme_cache_table_is_what_qkmla_cache_size_computes():
    """The README's headline table: bf16 bytes per token and layer at DeepSeek-V3 widths."""
    from qkmla.cache.size import CACHE_PRESETS, cache_rows

    readme = (ROOT / "README.md").read_text()
    table = {cells[0]: cells[1:] for line in readme.splitlines() if line.startswith("| DeepSeek-V3,")
             for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    presets = {"DeepSeek-V3, TP=8 view (16 heads)": "deepseek-v3-tp8", "DeepSeek-V3, all 128 heads": "deepseek-v3"}
    assert set(table) == set(presets)
    for label, preset in presets.items():
        b = {r["variant"]: r["bytes_per_token_layer"] for r in cache_rows(CACHE_PRESETS[preset], 1)}
        assert table[label] == [f"{b['mha']:,}", f"{b['mla']:,}",
                                f"{b['mla-qknorm']:,} (+{100 * (b['mla-qknorm'] / b['mla'] - 1):.1f}%)",
                                f"{b['mla-qknorm-full-key']:,} ({b['mla-qknorm-full-key'] / b['mla-qknorm']:.1f}x)"]


def test_readme_layer_example_runs():
    readme = (ROOT / "README.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                   if "from qkmla import MLA" in block)
    exec(compile(example, "README.md", "exec"), {})  # noqa: S102 -- the README's own code, run as a user would
