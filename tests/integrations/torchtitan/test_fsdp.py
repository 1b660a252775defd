"""QK-normed and QK-clipped torchtitan models under FSDP2 (``fully_shard``, the API torchtitan's
``apply_fsdp`` calls) on 2 CPU processes (gloo): one training step, each rank on half the batch,
against the same step in one process on the whole batch. torchtitan's own parallelize function
builds its device mesh on "cuda" on a CPU-only PyTorch (docs/torchtitan.md, "On a CPU"), so the
layers are sharded here as it would shard them: each block, then the model."""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

OVERRIDES = {"qk_norm": [("qk_norm", {"kind": "l2", "learnable_logit_scale": True})],
             "qk_clip": [("qk_clip", {"tau": 0.3})]}


def one_step(model, tokens, positions, clip: bool) -> float:
    """SGD on every parameter (a step linear in the gradient: AdamW's first step is about lr * sign(g),
    which reduction order flips where g is near 0), one step of mean next-token loss, QK-Clip after it
    when ``clip``."""
    from qkmla.integrations.torchtitan.clip import qk_clip_step

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logits = model(tokens[:, :-1], positions=positions[:, :-1],
                   attention_masks=model.get_attention_masks(positions[:, :-1]))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    if clip:
        qk_clip_step(model)
    return loss.item()


def full_state(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _rank(rank: int, world: int, store: str, result: str, variant: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import build, packed_positions, trainer_config

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = build(trainer_config(OVERRIDES[variant]).model_spec.model)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(5)
        tokens = torch.randint(0, 2048, (2 * world, 25))
        positions = packed_positions(2 * world, [11, 14])
        loss = one_step(model, tokens[2 * rank:2 * rank + 2], positions[2 * rank:2 * rank + 2], variant == "qk_clip")
        losses = [None] * world
        dist.all_gather_object(losses, loss)
        state = full_state(model)
        layer = model.layers["0"].attention
        clipped = None if layer.clipped_max_logits is None else layer.clipped_max_logits.clone()
        if rank == 0:
            torch.save({"losses": losses, "state": state, "clipped": clipped}, result)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", list(OVERRIDES))
def test_a_sharded_step_equals_the_same_step_in_one_process(titan, variant):
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.pt")
        torch.multiprocessing.spawn(_rank, args=(2, store, result, variant), nprocs=2, join=True)
        sharded = torch.load(result)
    model = titan.build(titan.config(OVERRIDES[variant]).model_spec.model)
    torch.manual_seed(5)
    tokens = torch.randint(0, 2048, (4, 25))
    positions = titan.positions(4, [11, 14])
    loss = one_step(model, tokens, positions, variant == "qk_clip")
    assert abs(sum(sharded["losses"]) / 2 - loss) < 1e-5
    reference = full_state(model)
    assert sorted(sharded["state"]) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(sharded["state"][name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if variant == "qk_clip":  # the max over both ranks' halves is the max over the whole batch: the same clip
        layer = model.layers["0"].attention
        assert (layer.clipped_max_logits < layer.step_max_logits).any()
        torch.testing.assert_close(sharded["clipped"], layer.clipped_max_logits, rtol=1e-5, atol=1e-6)
