"""docs/serving.md lists every part of vLLM the plugin imports, and nothing it no longer uses
(no vLLM needed: the plugin's source is read, not imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PLUGIN = ROOT / "src" / "qkmla" / "integrations" / "vllm"
DOC = ROOT / "docs" / "serving.md"
SECTION = "## The vLLM internals the plugin uses"
# vLLM's names for what the plugin receives, not names its source spells
RECEIVED = {"MLAModules": "the type of the layer's mla_modules argument", "VllmConfig": "the type of vllm_config",
            "multi_head_latent_attention": "the name vLLM registers its pluggable MLA layer under"}


def internals_section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end > 0 else None]


def vllm_imports() -> list[tuple[str, str, str]]:
    """(file, module without its leading 'vllm.', name) of every ``from vllm... import name`` and
    ``import vllm...`` in the plugin, at any depth (most are imported inside functions)."""
    found = []
    for path in sorted(PLUGIN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                found += [(path.name, node.module.removeprefix("vllm").lstrip("."), a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(path.name, a.name.removeprefix("vllm").lstrip("."), "") for a in node.names
                          if a.name.split(".")[0] == "vllm"]
    return found


def test_the_plugin_imports_vllm_somewhere():
    """The check below reads something: the plugin's source imports vLLM's classes."""
    modules = {module for _, module, _ in vllm_imports()}
    assert {"model_executor.layers.attention", "model_executor.custom_op", "v1.attention.backends.registry"} <= modules


def test_every_vllm_module_and_name_the_plugin_imports_is_listed():
    section = internals_section()
    missing = [f"{file}: vllm.{module}{'.' if module and name else ''}{name}" for file, module, name in vllm_imports()
               if (module and module not in section) or (name and name not in section)]
    assert not missing, f"docs/serving.md, '{SECTION[3:]}', does not name: {missing}"


def listed_identifiers() -> set[str]:
    """The identifiers in backticks in the first column of the section's tables (what vLLM provides)."""
    names = set()
    for line in internals_section().splitlines():
        if not line.startswith("| ") or line.startswith(("| vLLM ", "|---")):
            continue
        first = line.split(" | ")[0]
        for code in re.findall(r"`([^`]+)`", first):
            names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]{2,}", code))
    return names


def test_nothing_listed_is_gone_from_the_plugin():
    """Each identifier the section's tables name is still in the plugin's source (a vLLM internal
    dropped from the code leaves the list too)."""
    source = "\n".join(path.read_text() for path in PLUGIN.glob("*.py"))
    listed = listed_identifiers()
    assert {"MLAAttention", "op_registry_oot", "concat_and_cache_mla", "get_simultaneous"} <= listed
    gone = sorted(name for name in listed - set(RECEIVED) if not re.search(rf"\b{re.escape(name)}\b", source))
    assert not gone, f"docs/serving.md, '{SECTION[3:]}', names what the plugin no longer uses: {gone}"
