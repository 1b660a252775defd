import math
import os
import tempfile

import pytest
import torch

pytest.importorskip("torchtitan")

from qkmla.integrations.torchtitan.attention import close_steps  # noqa: E402
from qkmla.integrations.torchtitan.clip import qk_clip_step, scale_rows_  # noqa: E402
from qkmla.integrations.torchtitan.metrics import max_logit_metrics  # noqa: E402


def logits_of(model, x, positions):
    """Layer 0's pre-softmax logits [B, h, T, T] as its inner attention receives q, k and the scale."""
    layer = model.layers["0"].attention
    seen = {}
    inner = layer.inner_attention.forward

    def spy(q, k, v, *, attention_masks, scale=None, **kwargs):
        seen["logits"] = torch.einsum("bthd,bshd->bhts", q, k) * scale
        return inner(q, k, v, attention_masks=attention_masks, scale=scale, **kwargs)

    layer.inner_attention.forward = spy
    try:
        with torch.no_grad():
            layer(x, model.get_attention_masks(positions), positions)
    finally:
        del layer.inner_attention.forward
    return seen["logits"]


@pytest.mark.parametrize("q_lora", [False, True])
def test_qk_clip_multiplies_each_heads_logits_by_exactly_its_factor(titan, q_lora):
    """MLA-aware QK-Clip on torchtitan's layer: heads over tau come out with every logit multiplied
    by gamma_h = tau / S_h (so their max is tau), the others unchanged; the RoPE key is untouched."""
    config = titan.config([("qk_clip", {"tau": 1.0}), "max_logit_metrics"]).model_spec.model
    if q_lora:
        config = titan.config([("qk_clip", {"tau": 1.0})]).model_spec.model
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.nn_modules import RMSNorm

        for layer in config.layers:
            a = layer.attention
            a.q_lora_rank = 64
            a.wq_a = Linear.Config(in_features=256, out_features=64, param_init=a.wq.param_init)
            a.wq_b = Linear.Config(in_features=64, out_features=a.wq.out_features, param_init=a.wq.param_init)
            a.q_norm = RMSNorm.Config(normalized_shape=64, param_init=a.kv_norm.param_init)
            a.wq = None
    model = titan.build(config)
    layer = model.layers["0"].attention
    torch.manual_seed(3)
    x = torch.randn(2, 24, 256) * 3
    positions = titan.positions(2, [11, 13])
    before = logits_of(model, x, positions)
    k_rope_rows = layer.wkv_a.weight[512:].clone()
    layer.train()
    layer(x, model.get_attention_masks(positions), positions)
    measured = layer.running_max_logits.clone()
    tau = float(measured.median())  # some heads over it, some under
    layer.qk_clip_tau = tau
    gammas = qk_clip_step(model)
    gamma = gammas["layers.0.attention"]
    clipped = gamma < 1
    assert clipped.any() and not clipped.all(), measured  # both kinds of head in this test
    torch.testing.assert_close(gamma[clipped], tau / measured[clipped])
    after = logits_of(model, x, positions)
    torch.testing.assert_close(after, before * gamma[None, :, None, None], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.clipped_max_logits, torch.clamp(measured, max=tau))
    assert torch.equal(layer.wkv_a.weight[512:], k_rope_rows)
    layer(x, model.get_attention_masks(positions), positions)  # measured again: at most tau
    torch.testing.assert_close(layer.running_max_logits, torch.clamp(measured, max=tau), rtol=1e-4, atol=1e-5)
    assert set(gammas) == {"layers.0.attention"}  # layer 1 measured nothing this step: nothing to clip


def test_the_clip_runs_after_each_step_of_torchtitans_optimizer_container(titan, tokens):
    config = titan.config([("qk_clip", {"tau": 0.5}), "qk_clip_optimizer"])
    model = titan.build(config.model_spec.model)
    optimizer = config.optimizer.build(model_parts=[model])
    positions = titan.positions(2, [24])
    model.train()
    logits = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    layer = model.layers["0"].attention
    assert bool((layer.running_max_logits == -math.inf).all()) and layer.clipped_max_logits is not None
    assert float(layer.clipped_max_logits.max()) <= 0.5 + 1e-6
    assert layer.step_max_logits.max() > 0.5  # there was something to clip


def test_the_metric_reports_each_layers_max_logit_for_plain_normed_and_clipped_layers(titan, tokens):
    positions = titan.positions(2, [24])
    for overrides, clipped in (["max_logits"], False), ([("qk_norm", {"track_max_logits": True})], False), \
            ([("qk_clip", {"tau": 0.5})], True):
        model = titan.build(titan.config(overrides).model_spec.model)
        model.train()
        with torch.no_grad():
            model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
        if clipped:
            qk_clip_step(model)
        metrics = max_logit_metrics(model)
        layers = {k for k in metrics if k.startswith("max_logit/")}
        assert layers == {"max_logit/layer_0", "max_logit/layer_1"}, overrides
        assert metrics["max_logit"] == max(metrics[k] for k in layers) > 0
        assert metrics["max_logit/layer_0"] == float(model.layers["0"].attention.step_max_logits.max())
        assert ("max_logit_after_clip/layer_0" in metrics) == clipped
        if clipped:
            assert metrics["max_logit_after_clip/layer_0"] <= 0.5 + 1e-6 < metrics["max_logit/layer_0"]


def _ranks(rank: int, world: int, store: str, result: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        weight = torch.randn(10, 3)
        factors = torch.arange(1.0, 11.0)
        mesh = init_device_mesh("cpu", (world,))
        sharded = distribute_tensor(weight.clone(), mesh, [Shard(0)])
        scale_rows_(sharded, factors)
        full = sharded.full_tensor()

        class Fake(torch.nn.Module):  # close_steps over ranks: a layer named as torchtitan names it
            pass

        from qkmla.integrations.torchtitan.attention import QKAttention

        layer = QKAttention.__new__(QKAttention)
        torch.nn.Module.__init__(layer)
        layer.wkv_a = torch.nn.Linear(1, 1)
        layer.n_heads, layer.track_max_logits = 4, True
        layer.max_logit_meter = torch.nn.Module()
        layer.max_logit_meter.register_buffer("running", torch.tensor([1.0, 5.0, 2.0, 0.0] if rank == 0
                                                                      else [3.0, 1.0, 2.5, -1.0]))
        layer.step_max_logits = layer.clipped_max_logits = None
        holder = Fake()
        holder.layers = torch.nn.ModuleDict({"3": Fake()})
        holder.layers["3"].attention = layer
        closed = close_steps(holder)
        if rank == 0:
            torch.save({"full": full, "want": weight * factors[:, None], "closed": closed}, result)
    finally:
        dist.destroy_process_group()


def test_sharded_weights_are_clipped_on_each_ranks_rows_and_max_logits_reduce_over_ranks():
    """Two CPU processes (gloo): a weight sharded by rows as FSDP2 shards it is scaled row by row
    exactly as the whole weight is, and the per-head max logits are the max over the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.pt")
        torch.multiprocessing.spawn(_ranks, args=(2, store, result), nprocs=2, join=True)
        got = torch.load(result)
    assert torch.equal(got["full"], got["want"])
    assert torch.equal(got["closed"]["layers.3.attention"], torch.tensor([3.0, 5.0, 2.5, 0.0]))


def test_the_metrics_processor_hands_the_max_logits_to_torchtitans_log(titan, tokens, monkeypatch):
    """MaxLogitMetricsProcessor.log adds the figures to the extra metrics torchtitan's own log writes
    (its loggers: console, TensorBoard, W&B), beside what the trainer passed."""
    from torchtitan.components.metrics import MetricsProcessor

    from qkmla.integrations.torchtitan.metrics import MaxLogitMetricsProcessor

    seen = {}
    monkeypatch.setattr(MetricsProcessor, "log", lambda self, step, avg, mx, grad_norm, extra_metrics=None:
                        seen.update(step=step, extra=extra_metrics))
    model = titan.build(titan.config(["max_logits"]).model_spec.model)
    model.train()
    positions = titan.positions(2, [24])
    with torch.no_grad():
        model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    processor = MaxLogitMetricsProcessor.__new__(MaxLogitMetricsProcessor)  # its loggers need a GPU's memory monitor
    processor.model_parts = [model]
    processor.log(7, 2.5, 2.6, 1.0, extra_metrics={"n_tokens_seen": 48})
    assert seen["step"] == 7 and seen["extra"]["n_tokens_seen"] == 48
    assert {"max_logit", "max_logit/layer_0", "max_logit/layer_1"} <= set(seen["extra"])
    assert seen["extra"]["max_logit/layer_1"] == float(model.layers["1"].attention.step_max_logits.max())


def test_a_max_logit_that_overflowed_is_refused_not_clipped(titan, tokens):
    model = titan.build(titan.config([("qk_clip", {"tau": 1.0})]).model_spec.model)
    layer = model.layers["0"].attention
    layer.running_max_logits.copy_(torch.tensor([2.0] * 15 + [math.inf]))
    before = layer.wq.weight.clone()
    with pytest.raises(FloatingPointError, match=r"layers\.0\.attention: the step's max logit is inf"):
        qk_clip_step(model)
    assert torch.equal(layer.wq.weight, before)


def test_measuring_refuses_a_slice_of_the_heads_it_cannot_place(titan):
    """A rank holding h / 2 heads must know which: torchtitan's tensor parallelism says (its "tp"
    mesh, test_trainer.py); plain weights cannot."""
    model = titan.build(titan.config(["max_logits"]).model_spec.model)
    q = torch.randn(1, 4, 8, 192)
    with pytest.raises(ValueError, match="parallelism: this rank holds 8 of this layer's 16 heads, split in a way other"):
        model.layers["0"].attention._track(q, q, 1.0, None)
