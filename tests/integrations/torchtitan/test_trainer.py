"""torchtitan's own Trainer (``torchtitan.train``) with qkmla's config registry, on the CPU.

Each run is ``torchrun ... cpu_trainer.py --module qkmla.integrations.torchtitan --config ...``:
torchtitan's entry point behind the launcher that points its device at the CPU (its docstring
says what it changes and why). The runs start from one seed checkpoint (torchtitan's
``--checkpoint.create_seed_checkpoint``, its way of giving parallel runs the same weights), so a
parallel run's step is compared with the one-process run's.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

HARNESS = Path(__file__).with_name("cpu_trainer.py")
REGISTRY = ["--module", "qkmla.integrations.torchtitan"]
SMALL = ["--training.seq_len", "64", "--validator.no-enable", "--debug.seed", "0"]
OVERRIDES = "qkmla.integrations.torchtitan.overrides."
# the parallel runs' model: L2 with a learned logit scale [h] (split by heads under TP), measuring its max logits
L2 = ["--config", "qkmla_cpu_qk_norm", "--override.imports",
      OVERRIDES + 'qk_norm={"kind": "l2", "learnable_logit_scale": true, "track_max_logits": true}',
      OVERRIDES + "max_logit_metrics"]
MAX_LOGITS = re.compile(r"max_logit step:\s+(\d+)\s+all: [\d.]+\s+layers: ([\d. ]+)")
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([-\d.]+)\s+grad_norm:\s+([-\d.]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def train(dump: Path, *args: str, nproc: int = 1, timeout: int = 900) -> str:
    """torchtitan's Trainer on ``nproc`` CPU processes; its log (rank 0's lines first in each step)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HARNESS), *args, "--dump_folder", str(dump)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[3] / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    log = ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0, log[-6000:]
    return log


def steps(log: str) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} as torchtitan logs them."""
    return {int(m[1]): (float(m[2]), float(m[3])) for m in STEP.finditer(log)}


def max_logits(log: str) -> dict[int, list[float]]:
    """{step: each layer's max logit} from qkmla's console line."""
    return {int(m[1]): [float(v) for v in m[2].split()] for m in MAX_LOGITS.finditer(log)}


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """A seed checkpoint (step 0) of the ``cpu`` flavor, QK-normed (L2, learned logit scale)."""
    dump = tmp_path_factory.mktemp("seed")
    train(dump, *REGISTRY, *L2, *SMALL, "--checkpoint.enable",
          "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1")
    return dump / "checkpoint" / "step-0"


def from_seed(seed: Path) -> list[str]:
    return [*REGISTRY, *L2, *SMALL, "--training.steps", "3", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.no-last-save-model-only", "--checkpoint.keep_latest_k", "0",
            "--checkpoint.initial_load_path", str(seed)]


@pytest.fixture(scope="module")
def one_process(seed, tmp_path_factory) -> tuple[Path, dict, dict]:
    """Three QK-normed steps in one process, batch 4, checkpointed at steps 2 and 3: the dump folder,
    {step: (loss, grad norm)}, {step: max logits}."""
    dump = tmp_path_factory.mktemp("one")
    log = train(dump, *from_seed(seed), "--training.local_batch_size", "4")
    return dump, steps(log), max_logits(log)


def test_trainer_trains_the_qk_normed_config_and_validates_on_the_held_out_plays(tmp_path):
    """The registry's config as shipped (its validation on the held-out plays included), a few steps."""
    log = train(tmp_path, *REGISTRY, "--config", "qkmla_cpu_qk_norm", "--training.steps", "4",
                "--training.seq_len", "64", "--training.local_batch_size", "4", "--validator.freq", "4",
                "--validator.steps", "2")
    got = steps(log)
    assert sorted(got) == [1, 2, 3, 4] and got[4][0] < got[1][0]
    assert "Model qkmla_deepseek_v3 cpu" in log and re.search(r"validate step:\s+4\s+loss:", log)
    assert "QKAttention" in log or "qk_norm" in log  # torchtitan logs the override it applied


@pytest.mark.parametrize("extra", [[], ["--parallelism.expert_parallel_degree", "2"]], ids=["fsdp2", "fsdp2+ep2"])
def test_data_parallel_on_two_processes_takes_the_one_process_steps(seed, one_process, tmp_path, extra):
    """Two ranks of half the batch each, FSDP2 (and EP 2: the routed experts split over the ranks)
    through torchtitan's parallelize: the same gradient norms and max logits step by step as one
    process on the whole batch (torchtitan logs the loss summed over the ranks under
    ``full_dtensor``: twice the one-process mean here)."""
    log = train(tmp_path, *from_seed(seed), "--training.local_batch_size", "2", *extra, nproc=2)
    got, want = steps(log), one_process[1]
    assert sorted(got) == [1, 2, 3]
    for s in want:
        assert got[s][1] == pytest.approx(want[s][1], abs=2e-4)
        assert got[s][0] == pytest.approx(2 * want[s][0], abs=4e-4)
        assert max_logits(log)[s] == pytest.approx(one_process[2][s], abs=2e-3)


def test_tensor_parallel_on_two_processes_takes_the_one_process_steps(seed, one_process, tmp_path):
    """TP 2 (the heads split over two ranks: the learned logit scale split with them, qkmla's norm
    weights replicated as the latent norms' are, each rank measuring its own heads' max logits): the
    same losses, gradient norms and per-layer max logits as one process."""
    log = train(tmp_path, *from_seed(seed), "--training.local_batch_size", "4",
                "--parallelism.tensor_parallel_degree", "2", nproc=2)
    got, want = steps(log), one_process[1]
    assert sorted(got) == [1, 2, 3]
    for s in want:
        assert got[s][0] == pytest.approx(want[s][0], abs=2e-4)
        assert got[s][1] == pytest.approx(want[s][1], abs=2e-4)
        assert max_logits(log)[s] == pytest.approx(one_process[2][s], abs=2e-3)


def test_compiled_blocks_take_the_eager_steps(seed, one_process, tmp_path):
    """``--compile.enable``: torchtitan compiles each block (qkmla's norms and max-logit measurement
    inside) and the loss with inductor; the same steps as eager within compiled rounding."""
    log = train(tmp_path, *from_seed(seed), "--training.local_batch_size", "4", "--compile.enable")
    assert "Compiling each TransformerBlock with torch.compile" in log
    got, want = steps(log), one_process[1]
    assert sorted(got) == [1, 2, 3]
    for s in want:
        assert got[s] == pytest.approx(want[s], abs=1e-3)
        assert max_logits(log)[s] == pytest.approx(one_process[2][s], abs=1e-2)


def test_a_run_resumed_from_its_dcp_checkpoint_takes_the_same_steps(seed, one_process, tmp_path):
    """Step 3 of a run resumed from step 2's checkpoint (model, learned logit scale, optimizer,
    scheduler, data position) equals step 3 of the uninterrupted run."""
    dump, want, _ = one_process
    (tmp_path / "checkpoint").mkdir()
    os.symlink(dump / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    log = train(tmp_path, *from_seed(seed), "--training.local_batch_size", "4")
    got = steps(log)
    assert sorted(got) == [3], log[-3000:]
    assert got[3] == pytest.approx(want[3], abs=1e-5)


CLIP = [*REGISTRY, "--config", "qkmla_cpu_qk_clip", *SMALL, "--override.imports",
        OVERRIDES + 'qk_clip={"tau": 0.25}', OVERRIDES + "qk_clip_optimizer", OVERRIDES + "max_logit_metrics"]
CLIPPED = re.compile(r"max_logit step:\s+(\d+)\s+all: ([\d.]+)\s+after clip: ([\d.]+)\s+layers: ([\d. ]+)")


def clipped(log: str) -> dict[int, tuple[float, float, list[float]]]:
    """{step: (max logit, max logit after the clip, each layer's max logit)} from the console."""
    return {int(m[1]): (float(m[2]), float(m[3]), [float(v) for v in m[4].split()]) for m in CLIPPED.finditer(log)}


@pytest.fixture(scope="module")
def clip_one_process(tmp_path_factory) -> tuple[Path, dict, dict]:
    """QK-Clip with a threshold low enough to clip at every step (the freshly initialized model's
    logits are about 0.35): its seed checkpoint, then three steps in one process, batch 4."""
    seed = tmp_path_factory.mktemp("clip_seed")
    train(seed, *CLIP, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
          "--parallelism.data_parallel_shard_degree", "1")
    seed = seed / "checkpoint" / "step-0"
    log = train(tmp_path_factory.mktemp("clip_one"), *CLIP, "--training.steps", "3", "--checkpoint.enable",
                "--checkpoint.interval", "100", "--checkpoint.initial_load_path", str(seed),
                "--training.local_batch_size", "4")
    return seed, steps(log), clipped(log)


@pytest.mark.parametrize("extra", [["--training.local_batch_size", "2"],
                                   ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]],
                         ids=["fsdp2", "tp2"])
def test_qk_clip_on_two_processes_clips_as_one_process_does(clip_one_process, tmp_path, extra):
    """QK-Clip through torchtitan's Trainer on 2 ranks (FSDP2: the batch split, each rank scaling its
    own rows; TP 2: the heads split, each rank measuring and scaling its own heads): every step's max
    logits before and after the clip, and the gradient norms of the steps the clips shaped, as in one
    process; the first step clipped to tau."""
    seed, want, want_clip = clip_one_process
    log = train(tmp_path, *CLIP, "--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "100",
                "--checkpoint.initial_load_path", str(seed), *extra, nproc=2)
    got, got_clip = steps(log), clipped(log)
    assert sorted(got_clip) == sorted(want_clip) == [1, 2, 3]
    for s in want_clip:
        before, after, layers = got_clip[s]
        assert len(layers) == 4 and after <= 0.25 + 1e-4
        assert s > 1 or (before > 0.25 and after == pytest.approx(0.25, abs=1e-4))  # step 1 clips
        assert layers == pytest.approx(want_clip[s][2], abs=2e-3)
        assert got[s][1] == pytest.approx(want[s][1], abs=2e-4)


def test_a_trainer_checkpoint_exports_and_transformers_computes_torchtitans_logits(one_process, tmp_path, titan):
    """``python -m qkmla.integrations.torchtitan.export`` on the run's step-3 checkpoint with the run's
    arguments: the Hugging Face checkpoint's logits in transformers (qkmla's loader) equal those of
    torchtitan's model holding the checkpoint, its routed experts computed in float32 as
    transformers computes them (torchtitan's own cast to bfloat16); other runs' arguments are refused."""
    from torchtitan.config import derive

    from qkmla.integrations.torchtitan.export import config_from_args, load_dcp, main, model_from_args
    from qkmla.integrations.torchtitan.flavors import materialize
    from qkmla.integrations.transformers import from_pretrained
    from tests.integrations.torchtitan.test_checkpoint import Float32Experts

    dump = one_process[0]
    step = dump / "checkpoint" / "step-3"
    args = [*REGISTRY, *L2, "--training.seq_len", "64"]
    assert main([str(step), str(tmp_path / "hf"), "--", *args]) == 0
    record = json.loads((tmp_path / "hf" / "config.json").read_text())["qkmla"]["qk_norm"]
    assert record["kind"] == "l2" and record["learnable_logit_scale"] is True
    config = config_from_args(args).model_spec.model
    for layer in config.layers:
        if layer.moe is not None:
            experts = layer.moe.routed_experts
            experts.inner_experts = derive(experts.inner_experts, Float32Experts.Config)
    model = materialize(config)
    load_dcp(step, model)
    tokens = torch.tensor([list(b"O Romeo, Romeo! wherefore art thou Romeo?")])
    want = titan.logits(model, tokens)
    with torch.no_grad():
        got = from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)(tokens).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    # a plain run's arguments, and another norm's, do not describe this checkpoint
    assert main([str(step), str(tmp_path / "plain"), "--", *REGISTRY, "--config", "qkmla_cpu"]) == 2
    lp = OVERRIDES + 'qk_norm={"kind": "lp", "p": 3, "learnable_logit_scale": true}'
    with pytest.raises(ValueError, match=r"checkpoint: .*l2.*QK norm.*lp"):
        load_dcp(step, model_from_args([*REGISTRY, "--config", "qkmla_cpu_qk_norm", "--override.imports", lp]))
    assert not (tmp_path / "plain").exists()
