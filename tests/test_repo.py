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


# DeepSeek-V2-Lite's published config.json (deepseek-ai/DeepSeek-V2-Lite-Chat), the fields that
# decide its size: the README's real-model example names it.
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
               n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
               q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               tie_word_embeddings=False)


def test_readme_real_model_figures_are_its_parameters_and_cache_bytes():
    """The README's DeepSeek-V2-Lite-Chat: parameters and bf16 weight bytes counted from the
    published config (built on the meta device), cache bytes from ``qkmla cache-size``."""
    transformers = pytest.importorskip("transformers")
    import torch

    from qkmla.cache.size import CACHE_PRESETS, cache_rows

    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**V2_LITE))
    params = sum(p.numel() for p in model.parameters())
    shape = CACHE_PRESETS["deepseek-v2-lite"].replace(dtype="bf16")
    rows = {r["variant"]: r["bytes_per_token"] for r in cache_rows(shape, 1)}
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"({params / 1e9:.1f}B parameters: {2 * params / 1e9:.1f} GB of weights; its latent cache holds "
            f"{rows['mla']:,} bytes per token over all {V2_LITE['num_hidden_layers']} layers, where MHA's keys and "
            f"values would take {rows['mha']:,})") in readme
    assert f"({rows['mla-qknorm']:,} bytes per token then)" in readme
