"""A patched model whose weights are split across processes: transformers' tensor parallelism
(``tp_plan="auto"``) on two CPU processes (gloo) where its plan leaves the attention whole
(DeepSeek-V3), refused where it shards it (DeepSeek-V2) and under DeepSpeed ZeRO-3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import apply_latent_attention  # noqa: E402

from tests.integrations.transformers.test_model import hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = '''
import sys, torch, torch.distributed as dist, transformers
from qkmla.integrations.transformers import apply_latent_attention
path, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
try:
    apply_latent_attention(model, qk_norm="rms")
except ValueError as e:
    print(f"rank {dist.get_rank()} refused: {e}")
    sys.exit(0)
ids = torch.tensor([[5, 17, 3, 42, 8, 11, 29, 2], [9, 4, 71, 6, 13, 50, 1, 33]])
logits = model(ids).logits
tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
if dist.get_rank() == 0:
    torch.save({"tp_size": model._tp_size, "logits": logits, "tokens": tokens}, out)
dist.destroy_process_group()
'''


def run_tp(path: Path, out: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]))}
    worker = out.with_name("worker.py")
    worker.write_text(WORKER)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), str(path), str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_tensor_parallel_on_two_processes_computes_the_one_process_model(tmp_path):
    """DeepSeek-V3's plan shards the MLP and experts only: the patched model on two processes computes
    the one-process patched model's logits and greedy tokens."""
    model = hf_model("v3", dtype=torch.float32)  # transformers' sharded experts take no float64
    model.save_pretrained(tmp_path / "model")
    run_tp(tmp_path / "model", tmp_path / "tp.pt")
    got = torch.load(tmp_path / "tp.pt")
    assert got["tp_size"] == 2
    one = apply_latent_attention(model, qk_norm="rms")
    ids = torch.tensor([[5, 17, 3, 42, 8, 11, 29, 2], [9, 4, 71, 6, 13, 50, 1, 33]])
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], one(ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(got["tokens"], one.generate(ids, max_new_tokens=6, do_sample=False))


def test_a_plan_that_shards_the_attention_is_refused_before_any_work():
    """DeepSeek-V2's plan shards q_b_proj, kv_b_proj and o_proj by heads (as loaded with tp_plan="auto"
    on two processes: tp_size 2)."""
    model = hf_model("v2")
    model._tp_size = 2
    with pytest.raises(ValueError, match=r"model: transformers' tensor parallelism \(tp_plan, 2 processes\) shards "
                                         r"its attention \(layers\.\*\.self_attn\."):
        apply_latent_attention(model)
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV2Attention"  # nothing patched


def test_deepspeed_zero3_is_refused_before_any_work(monkeypatch):
    import transformers.integrations.deepspeed as deepspeed

    model = hf_model("v3")
    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match="model: its weights are partitioned by DeepSpeed ZeRO-3"):
        apply_latent_attention(model)
    monkeypatch.undo()
    model.model.layers[0].self_attn.kv_b_proj.weight.ds_id = 7  # a ZeRO-3 partitioned parameter's mark
    with pytest.raises(ValueError, match="ZeRO-3"):
        apply_latent_attention(model)
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"  # nothing patched
