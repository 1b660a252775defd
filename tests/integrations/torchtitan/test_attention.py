import math

import pytest
import torch

pytest.importorskip("torchtitan")

from qkmla import QKNormConfig  # noqa: E402
from qkmla.attention.functional import max_logits  # noqa: E402
from qkmla.integrations.torchtitan.attention import QKAttention, close_steps, document_mask  # noqa: E402

NORMS = {
    "rms blockwise": {},
    "rms unified": {"mode": "unified"},
    "rms content": {"mode": "content"},
    "l2 learned scale": {"kind": "l2", "learnable_logit_scale": True},
    "lp3": {"kind": "lp", "p": 3.0},
    "rms projection": {"scope": "projection"},
}


def layer0(model) -> QKAttention:
    return model.layers["0"].attention


def captured_qk(layer, x, positions):
    """The q, k [B, T, h, D] and scale the layer hands its inner attention."""
    seen = {}
    inner = layer.inner_attention.forward

    def spy(q, k, v, *, attention_masks, scale=None, **kwargs):
        seen.update(q=q, k=k, scale=scale)
        return inner(q, k, v, attention_masks=attention_masks, scale=scale, **kwargs)

    layer.inner_attention.forward = spy
    try:
        layer(x, None if positions is None else layer_masks(positions), positions)
    finally:
        del layer.inner_attention.forward
    return seen["q"], seen["k"], seen["scale"]


_MODEL = {}


def layer_masks(positions):
    return _MODEL["model"].get_attention_masks(positions)


def test_a_plain_layer_computes_what_torchtitans_own_layer_computes(titan, tokens):
    """The max_logits override: the same parameters and the same output, bit for bit."""
    stock = titan.build(titan.config().model_spec.model)
    plain = titan.build(titan.config(["max_logits"]).model_spec.model)
    assert type(layer0(plain)) is QKAttention and type(layer0(stock)) is not QKAttention
    assert sorted(plain.state_dict()) == sorted(stock.state_dict())
    plain.load_state_dict(stock.state_dict())
    positions = titan.positions(2, [14, 10])
    masks = stock.get_attention_masks(positions)
    with torch.no_grad():
        assert torch.equal(plain(tokens, positions=positions, attention_masks=masks),
                           stock(tokens, positions=positions, attention_masks=masks))


@pytest.mark.parametrize("norm", list(NORMS))
def test_a_normed_layer_builds_qkmlas_norm_under_names_that_say_what_it_is(titan, norm):
    config = titan.config([("qk_norm", NORMS[norm])]).model_spec.model
    model = titan.build(config)
    layer = layer0(model)
    assert layer.qk_norm_config == QKNormConfig(**NORMS[norm])
    names = {n.split("attention.", 1)[1] for n, _ in model.named_parameters() if n.startswith("layers.0.attention.")}
    ours = {"q_head_norm.content.weight", "q_head_norm.rope.weight", "k_head_norm.content.weight",
            "k_head_norm.rope.weight"} | ({"logit_scale"} if "learned" in norm else set())
    assert ours <= names and {"q_norm.weight", "kv_norm.weight"} & names  # torchtitan's latent norms stay theirs
    # torchtitan initializes on the meta device, then init_states: our weights are set there
    for name in ours - {"logit_scale"}:
        assert torch.equal(model.get_parameter(f"layers.0.attention.{name}"),
                           torch.ones_like(model.get_parameter(f"layers.0.attention.{name}")))
    if "learned" in norm:  # L2 vectors: tau_0 = sqrt(d_n + d_r), an RMS head's logit size
        torch.testing.assert_close(layer.logit_scale, torch.full((16,), math.sqrt(192.0)))


@pytest.mark.parametrize("norm", list(NORMS))
def test_normed_logits_do_not_depend_on_each_heads_query_and_key_magnitudes(titan, tokens, norm):
    """What the norm is for: scaling a head's query rows or a head's content key rows (W_UK) leaves
    its logits unchanged (blockwise: each block's scale on its own; unified/content: together)."""
    config = titan.config([("qk_norm", NORMS[norm])]).model_spec.model
    model = titan.build(config)
    _MODEL["model"] = model
    layer = layer0(model)
    torch.manual_seed(2)
    x = torch.randn(2, 24, 256)
    positions = titan.positions(2, [24])
    with torch.no_grad():
        for qk in (layer.q_head_norm, layer.k_head_norm):  # weights away from ones
            for w in qk.parameters():
                w.copy_(1 + 0.3 * torch.randn_like(w))
        q0, k0, s0 = captured_qk(layer, x, positions)
        heads, d_n, d_r, d_v = 16, 128, 64, 128
        w_q = layer.wq.weight.view(heads, d_n + d_r, -1)
        w_kv = layer.wkv_b.weight.view(heads, d_n + d_v, -1)
        unified = NORMS[norm].get("mode") in ("unified", "content") or NORMS[norm].get("scope") == "projection"
        if unified:  # one statistic over both blocks (or all heads): scale a side's blocks together
            layer.wq.weight.mul_(3.0)
            w_kv[:, :d_n].mul_(5.0)
            layer.wkv_a.weight[512:].mul_(5.0)  # k^R's rows (the latent's rows feed kv_norm: no effect)
        else:
            w_q[3, :d_n].mul_(3.0)
            w_q[5, d_n:].mul_(0.25)
            w_kv[7, :d_n].mul_(5.0)
        q1, k1, s1 = captured_qk(layer, x, positions)
    logits = [torch.einsum("bthd,bshd->bhts", q, k) * s for q, k, s in ((q0, k0, s0), (q1, k1, s1))]
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-4, atol=2e-4)
    assert logits[0].abs().max() > 1e-2  # not vanishing (Lp unit vectors with a fixed scale give small logits)


def test_the_learned_logit_scale_multiplies_each_heads_logits_and_learns(titan, tokens):
    model = titan.build(titan.config([("qk_norm", {"kind": "l2", "learnable_logit_scale": True,
                                                   "logit_scale_init": 2.0})]).model_spec.model)
    _MODEL["model"] = model
    layer = layer0(model)
    positions = titan.positions(2, [24])
    x = torch.randn(2, 24, 256)
    with torch.no_grad():
        q0, k0, _ = captured_qk(layer, x, positions)
        layer.logit_scale[4] = 6.0
        q1, k1, s1 = captured_qk(layer, x, positions)
    assert s1 == 1.0
    before, after = torch.einsum("bthd,bshd->bhts", q0, k0), torch.einsum("bthd,bshd->bhts", q1, k1)
    torch.testing.assert_close(after[:, 4], 3.0 * before[:, 4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[:, 3], before[:, 3], rtol=1e-4, atol=1e-4)
    assert before[:, 4].abs().max() > 0.1
    model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions)).float().mean().backward()
    assert layer.logit_scale.grad is not None and layer.logit_scale.grad.abs().sum() > 0
    assert layer.q_head_norm.content.weight.grad.abs().sum() > 0


def test_max_logits_are_measured_within_each_packed_document(titan, tokens):
    """The tracked per-head max equals the max over the logits attention uses (causal, within each
    document), not over the whole causal row: the QK-Clip statistic."""
    model = titan.build(titan.config(["max_logits"]).model_spec.model)
    _MODEL["model"] = model
    layer = layer0(model)
    positions = titan.positions(2, [9, 15])
    x = torch.randn(2, 24, 256) * 4
    with torch.no_grad():
        q, k, scale = captured_qk(layer, x, positions)
    logits = torch.einsum("bthd,bshd->bhts", q, k).double() * scale
    document = torch.tensor([0] * 9 + [1] * 15)
    used = (document[:, None] == document[None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    want = logits.masked_fill(~used, -math.inf).amax(dim=(0, 2, 3))
    assert not torch.equal(want, logits.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
                           .amax(dim=(0, 2, 3)))  # the documents matter for these inputs
    layer.train()
    layer.running_max_logits.fill_(-math.inf)  # the spy's forward above measured too
    buffer = layer.running_max_logits.data_ptr()
    layer(x, model.get_attention_masks(positions), positions)
    torch.testing.assert_close(layer.running_max_logits.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(max_logits(q, k, scale, allowed=document_mask(positions)).double(), want,
                               rtol=1e-5, atol=1e-5)
    layer(x * 0.5, model.get_attention_masks(positions), positions)  # a second micro-batch: the running max
    closed = close_steps(model)
    torch.testing.assert_close(closed["layers.0.attention"].double(), want, rtol=1e-5, atol=1e-5)
    assert bool((layer.running_max_logits == -math.inf).all()) and close_steps(model) == {}
    # measured and restarted in place, in one buffer: what torchtitan's CUDA graphs replay
    assert layer.running_max_logits.data_ptr() == buffer
    assert model.get_buffer("layers.0.attention.max_logit_meter.running") is layer.running_max_logits
    assert not any("max_logit_meter" in k for k in model.state_dict())  # not saved in checkpoints
    layer.eval()
    layer(x, model.get_attention_masks(positions), positions)  # not measured outside training
    assert bool((layer.running_max_logits == -math.inf).all())


def test_a_whole_model_trains_on_the_cpu_through_the_normed_layers(titan, tokens):
    """Forward and backward of torchtitan's model, packed documents, batch 2: every norm weight
    gets a gradient and a few AdamW steps lower the loss on a repeated batch."""
    model = titan.build(titan.config([("qk_norm", {"track_max_logits": True})]).model_spec.model)
    positions = titan.positions(2, [10, 14])
    masks = model.get_attention_masks(positions)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        logits = model(tokens[:, :-1], positions=positions[:, :-1], attention_masks=model.get_attention_masks(
            positions[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            if "head_norm" in name:
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert masks is not None and set(close_steps(model)) == {"layers.0.attention", "layers.1.attention"}


def test_torchtitans_block_compile_takes_the_normed_layer_whole(titan, tokens):
    """torchtitan's apply_compile (each block, fullgraph=True, inductor) over a QK-normed layer that
    measures its max logits: no graph break, the eager outputs, gradients and the measured maxima."""
    import types

    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    config = titan.config([("qk_norm", {"kind": "lp", "p": 3.0, "learnable_logit_scale": True,
                                        "track_max_logits": True})], layers=1)
    eager = titan.build(config.model_spec.model)
    compiled = titan.build(config.model_spec.model)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, compile_config=CompileConfig(enable=True, backend="inductor"),
                  parallel_dims=types.SimpleNamespace(tp_enabled=False))
    positions = titan.positions(2, [10, 14])
    masks = eager.get_attention_masks(positions)
    outputs = []
    for model in (eager, compiled):
        model.train()
        out = model(tokens, positions=positions, attention_masks=masks)
        out.float().logsumexp(-1).mean().backward()
        outputs.append((out, model.layers["0"].attention))
    (out_e, layer_e), (out_c, layer_c) = outputs
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer_c.running_max_logits, layer_e.running_max_logits, rtol=1e-5, atol=1e-5)
    for name in ("q_head_norm.content.weight", "k_head_norm.rope.weight", "logit_scale"):
        torch.testing.assert_close(layer_c.get_parameter(name).grad, layer_e.get_parameter(name).grad,
                                   rtol=1e-3, atol=1e-6)


def test_torchtitans_state_distribution_finds_a_placement_for_every_parameter(titan):
    """torchtitan's parallelize distributes each Module's own parameters by its sharding config
    (DeepSeek-V3's names only torchtitan's): the learned logit scale gets one too. (Distributing
    needs a device mesh, which torchtitan builds on CUDA: here only the declaration is checked,
    with a mesh-less ParallelDims stand-in; the norms' weights sit in plain modules, which
    torchtitan's parallelize leaves as they are.)"""
    import types

    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    config = titan.config([("qk_norm", {"kind": "l2", "learnable_logit_scale": True})], layers=1)
    set_deepseek_v3_sharding_config(config.model_spec.model, enable_sp=False, enable_ep=False)
    layer = titan.build(config.model_spec.model).layers["0"].attention
    layer._distribute_states(types.SimpleNamespace(spmd_backend="full_dtensor", resolve_mesh=lambda axes: None))
    assert "logit_scale" in layer._sharding_config.state_shardings
