"""transformers' own DeepSeek-V2/V3 model tests, run on stock and on patched models (issue 52, point 8).

Both files run in a pytest subprocess per mode, the two side by side: stock
(``QKMLA_CONFORMANCE=stock``) and with every DeepSeek model they build patched
(``qkmla_conformance.py``); a test fails here if a test that passes on stock does not pass
patched, bar ``EXPECTED_FAILURES``.

The test tree: ``QKMLA_TRANSFORMERS_TESTS``, a transformers checkout at the installed version
(its ``tests/`` and ``src/``; ``git clone --depth 1 -b v<version>
https://github.com/huggingface/transformers``). The test files are in neither transformers'
wheel nor its sdist, and this repository carries no copy of another project's code, so without
a tree the module skips, saying how to get one.

The tests: :data:`SELECT` by default, the tests of the two files that exercise what the adapter
changes, kept small for CI; ``QKMLA_CONFORMANCE_SELECT`` takes another pytest ``-k`` expression,
or ``all`` for the whole files (a quarter of an hour per file and mode on the loaded 2-core CPU,
most of it in the tensor-parallel and compiled-generate tests).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODELS = ("deepseek_v2", "deepseek_v3")

# What the adapter changes, by the tests of the two files that run on a CPU and exercise it:
# attention (weights asked for per call, custom 4-D masks, packed sequences against the padded
# run, gradients through the attention weights, training with and without gradient
# checkpointing), the cache and generate (greedy and beam search with their dict outputs and
# cache, sampling, continuing from past_key_values and its format, left padding, inputs_embeds,
# assisted and prompt-lookup decoding, which crop the cache), position ids given or not, the
# static cache, meta-device builds followed by weight loading (save/load, from_pretrained without a
# checkpoint, init on meta, device context managers), and rope types (linear, dynamic, yarn).
# Left out, to keep CI's added time to minutes (docs/interop.md gives the whole-file counts, which
# include them): the compiled-generate tests (about 2 minutes of torch.compile each on a loaded CPU),
# the tensor-parallel ones (2 processes, about 2 minutes each), test_training_overfit (1 minute),
# test_bc_torch_dtype (30 s), the eager-vs-SDPA grid (on a patched model both sides are the latent
# attention), test_can_init_all_missing_weights (10 s; meta-device init is covered above), the
# pipelines (tiny models from the hub), the loading, resizing and offloading tests that do not reach
# the attention, the gradient-checkpointing variants, and the flash-attention, accelerator and @slow
# tests (skipped on a CPU anyway).
SELECT = " or ".join([
    "test_attention_outputs", "test_custom_4d_attention_mask", "padding_matches_padding_free_with_position_ids",
    "test_retain_grad_hidden_states_attentions", "test_batching_equivalence",
    "(test_training and not overfit and not use_reentrant)",
    "test_greedy_generate", "test_beam_search_generate_dict_outputs_use_cache", "test_sample_generate_dict_output",
    "test_generate_continue_from_past_key_values", "test_past_key_values_format", "test_left_padding_compatibility",
    "test_generate_from_inputs_embeds", "test_assisted_decoding_matches_greedy_search",
    "test_prompt_lookup_decoding_matches_greedy_search", "test_generate_with_and_without_position_ids",
    "test_generate_with_static_cache", "test_save_load", "test_from_pretrained_no_checkpoint",
    "test_can_be_initialized_on_meta", "test_can_load_with_device_context_manager",
    "test_can_load_with_global_device_set", "rope_scaling",
])


def installed_transformers() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def tree_version(tree: Path) -> str | None:
    """The transformers version a checkout is at (its source's ``__version__``), or None if
    ``tree`` is not a transformers checkout."""
    source = tree / "src" / "transformers" / "__init__.py"
    found = re.search(r'__version__ = "([^"]+)"', source.read_text()) if source.is_file() else None
    return found.group(1) if found else None


def selection() -> list[str]:
    chosen = os.environ.get("QKMLA_CONFORMANCE_SELECT", SELECT)
    return [] if chosen == "all" else ["-k", chosen]


def outcomes(junit: Path) -> dict[tuple[str, str], str]:
    """(model, test name) -> "passed", "failed", "skipped" or "xfailed" (``skipped`` with an xfail message)."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        model = next(m for m in MODELS if f".{m}." in f".{case.get('classname')}.")
        kinds = [child.tag for child in case]
        skipped = case.find("skipped")
        if "failure" in kinds or "error" in kinds:
            outcome = "failed"
        elif skipped is not None:
            outcome = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            outcome = "passed"
        result[model, case.get("name")] = outcome
    return result


def start(tree: Path, mode: str, out: Path) -> subprocess.Popen:
    """Both model test files in one pytest run (one collection: importing transformers' test
    machinery is most of a short run), in ``mode`` ("stock" or "patched"); junit xml and the log
    go to ``out``."""
    # One thread: the models are tiny, and on a shared 2-core machine (CI runs two streams side by
    # side) two OpenMP threads per process made the same tests up to 15 times slower.
    env = dict(os.environ, QKMLA_CONFORMANCE=mode, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(tree), os.environ.get("PYTHONPATH", "")]))
    with open(out / f"{mode}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 "-p", "qkmla_conformance", "--rootdir", str(tree),
                                 "--confcutdir", str(tree / "tests"), f"--junitxml={out / f'{mode}.xml'}",
                                 *selection(), *(f"tests/models/{m}/test_modeling_{m}.py" for m in MODELS)],
                                cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    version = installed_transformers()
    if version is None:
        pytest.skip("transformers is not installed")
    given = os.environ.get("QKMLA_TRANSFORMERS_TESTS")
    get = (f"git clone --depth 1 -b v{version} https://github.com/huggingface/transformers DIR, then "
           f"QKMLA_TRANSFORMERS_TESTS=DIR (docs/interop.md, 'transformers' own model tests')")
    if not given:
        pytest.skip(f"transformers' model test files ship in neither its wheel nor its sdist ({version} installed): "
                    f"{get}")
    tree = Path(given)
    if tree_version(tree) is None:
        pytest.skip(f"QKMLA_TRANSFORMERS_TESTS={tree} is not a transformers checkout (no src/transformers "
                    f"with a __version__): {get}")
    if tree_version(tree) != version:
        pytest.skip(f"QKMLA_TRANSFORMERS_TESTS={tree} is transformers {tree_version(tree)}, the installed one is "
                    f"{version}: {get}")
    out = tmp_path_factory.mktemp("conformance")
    # The two runs are independent: side by side they keep two cores busy.
    began = time.monotonic()
    processes = {mode: start(tree, mode, out) for mode in ("stock", "patched")}
    found = {}
    for mode, process in processes.items():
        process.wait()
        log = (out / f"{mode}.log").read_text()
        if not (out / f"{mode}.xml").exists():
            pytest.fail(f"the {mode} run of transformers' DeepSeek model tests wrote no junit xml:\n{log[-3000:]}")
        found[mode] = outcomes(out / f"{mode}.xml")
        counts = {kind: list(found[mode].values()).count(kind) for kind in sorted(set(found[mode].values()))}
        summary = next((line for line in reversed(log.splitlines()) if " in " in line and "passed" in line), "")
        print(f"transformers' DeepSeek model tests, {mode}: {counts} (pytest: {summary.strip('= ')})")
    print(f"both runs in {time.monotonic() - began:.0f} s")
    return found["stock"], found["patched"]


@pytest.mark.parametrize("model", MODELS)
def test_transformers_model_tests_pass_patched_where_they_pass_stock(model, runs):
    sys.path.insert(0, str(HERE))
    from qkmla_conformance import expected_failure

    stock, patched = runs
    ran = [name for (m, name), outcome in stock.items() if m == model and outcome == "passed"]
    assert ran, f"no test of transformers' {model} file passed on stock: the selection ran nothing"
    lost = sorted(name for name in ran if patched.get((model, name)) != "passed" and expected_failure(name) is None)
    assert not lost, f"{len(lost)} of transformers' {model} tests pass stock but not patched: {lost}"
