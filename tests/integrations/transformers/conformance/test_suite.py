"""transformers' own DeepSeek-V2/V3 model tests, run on stock and on patched models (issue 52, point 8).

Opt-in: set ``QKMLA_TRANSFORMERS_TESTS`` to a transformers source tree (its ``tests/`` and
``src/``, at the installed transformers version; how to get one: docs/interop.md). Each test
here runs one model test file twice in a subprocess, stock (``QKMLA_CONFORMANCE=stock``) and
with every DeepSeek model it builds patched (``qkmla_conformance.py``), and fails if a test that
passes on stock does not pass patched, bar ``EXPECTED_FAILURES``. Slow: over an hour per file
on a loaded 2-core CPU; ``QKMLA_CONFORMANCE_SELECT`` (a pytest ``-k`` expression, e.g.
``"generate or cache or attention or past_key"``) runs a subset of each file, both ways.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TREE = os.environ.get("QKMLA_TRANSFORMERS_TESTS")
SELECT = os.environ.get("QKMLA_CONFORMANCE_SELECT")


def tree_version(tree: Path) -> str:
    text = (tree / "src" / "transformers" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def outcomes(junit: Path) -> dict[str, str]:
    """test name -> "passed", "failed", "skipped" or "xfailed" (``skipped`` with an xfail message)."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        kinds = [child.tag for child in case]
        skipped = case.find("skipped")
        if "failure" in kinds or "error" in kinds:
            result[name] = "failed"
        elif skipped is not None:
            result[name] = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            result[name] = "passed"
    return result


def run(tree: Path, model: str, mode: str, out: Path) -> dict[str, str]:
    junit = out / f"{model}-{mode}.xml"
    env = dict(os.environ, QKMLA_CONFORMANCE=mode,
               PYTHONPATH=os.pathsep.join([str(HERE), str(tree), os.environ.get("PYTHONPATH", "")]))
    select = ["-k", SELECT] if SELECT else []
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "qkmla_conformance",
                    "--confcutdir", str(tree / "tests"), f"--junitxml={junit}", *select,
                    f"tests/models/{model}/test_modeling_{model}.py"], cwd=tree, env=env, check=False)
    return outcomes(junit)


@pytest.mark.parametrize("model", ["deepseek_v2", "deepseek_v3"])
def test_transformers_model_tests_pass_patched_where_they_pass_stock(model, tmp_path):
    if not TREE:
        pytest.skip("QKMLA_TRANSFORMERS_TESTS is not set: no transformers source tree to run its DeepSeek model "
                    "tests from (docs/interop.md, 'transformers' own model tests')")
    transformers = pytest.importorskip("transformers")
    tree = Path(TREE)
    if tree_version(tree) != transformers.__version__:
        pytest.skip(f"QKMLA_TRANSFORMERS_TESTS is transformers {tree_version(tree)}, the installed one is "
                    f"{transformers.__version__}: run the test files of the installed version")
    sys.path.insert(0, str(HERE))
    from qkmla_conformance import expected_failure

    stock, patched = run(tree, model, "stock", tmp_path), run(tree, model, "patched", tmp_path)
    lost = sorted(name for name, outcome in stock.items()
                  if outcome == "passed" and patched.get(name) != "passed" and expected_failure(name) is None)
    assert not lost, f"{len(lost)} of transformers' {model} tests pass stock but not patched: {lost}"
