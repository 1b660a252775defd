"""An MLA layer's absorbed decode step and autograd: trained through in training mode (its gradient
the explicit path's), inference in eval mode even outside torch.no_grad (the fast paths, a backward
that refuses)."""

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig
from qkmla.attention import mla as mla_module

CFG = MLAConfig(hidden_size=64, num_heads=4, num_kv_groups=2, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=32, qk_norm="rms")


def assert_cached_gradient_is_explicit(mla: MLA, x: torch.Tensor, prefill: int, cached_steps) -> None:
    """The parameters' gradient of the tokens after ``prefill`` through ``cached_steps(cache)`` (their
    outputs, [B, T - prefill, hidden]) equals the explicit path's over all of x, to float64 roundoff."""
    mla(x)[:, prefill:].square().sum().backward()
    want = {n: p.grad.clone() for n, p in mla.named_parameters()}
    mla.zero_grad()
    cache = LatentCache.from_config(CFG, x.shape[0], x.shape[1] + 1, dtype=x.dtype)
    mla(x[:, :prefill], cache)
    cached_steps(cache).square().sum().backward()
    for name, p in mla.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-8, atol=1e-12, msg=name)


def test_an_eval_decode_outside_no_grad_is_inference_and_its_backward_refuses():
    """A plain decode loop in eval mode without torch.no_grad took the recording path: the absorbed
    weights derived again at every step and the cache's rows copied densely and kept in the graph
    (memory growing with steps x context). It now runs as under no_grad, and says so at backward."""
    torch.manual_seed(0)
    mla = MLA(CFG).eval()
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        ref = LatentCache.from_config(CFG, 2, 16)
        mla(x[:, :5], ref)
        want = [mla(x[:, t:t + 1], ref) for t in range(5, 8)]
    cache = LatentCache.from_config(CFG, 2, 16)
    with torch.no_grad():  # (the explicit prefill outside no_grad keeps its own graph, as any forward does)
        mla(x[:, :5], cache)
    kept = mla._absorbed.weights
    got = [mla(x[:, t:t + 1], cache) for t in range(5, 8)]
    assert mla._absorbed.weights is kept  # not derived again
    assert not cache.decode_view()["kv_cache"].requires_grad  # the decode steps kept no graph in the cache
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    refusal = (r"^attention: an MLA decode step in eval mode is inference .* put the MLA modules in training mode .* "
               r"or decode under torch.no_grad\(\)")
    with pytest.raises(RuntimeError, match=refusal):
        got[-1].sum().backward()


def test_a_training_decode_step_derives_its_weights_once(monkeypatch):
    """Trained through, a step derived the absorbed weights three times (query, key scalars, values)."""
    calls = []
    absorb = mla_module.absorb
    monkeypatch.setattr(mla_module, "absorb", lambda *a, **k: calls.append(k.get("track")) or absorb(*a, **k))
    torch.manual_seed(0)
    mla = MLA(CFG)
    x = torch.randn(2, 6, 64)
    cache = LatentCache.from_config(CFG, 2, 8)
    mla(x[:, :5], cache)
    calls.clear()
    mla(x[:, 5:], cache).sum().backward()
    assert calls == [True]


def test_a_bf16_decode_step_with_only_kv_b_proj_trained_matches_the_explicit_path():
    """With only kv_b_proj trainable, a bf16 decode step run after a no_grad one (which built the
    kernels' packed weights) read the key scalars through a kernel with no backward: kv_b_proj's
    gradient was off by 0.103 relative to the explicit path (small_linear.group_statistic now takes
    the torch path for tracked weights): 0.0078 now, bf16's own error."""
    torch.manual_seed(0)
    cfg = MLAConfig(hidden_size=128, num_heads=4, num_kv_groups=2, kv_lora_rank=64, qk_nope_head_dim=32,
                    qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=32, qk_norm="rms")
    mla = MLA(cfg).to(torch.bfloat16)
    for n, p in mla.named_parameters():
        p.requires_grad_("kv_b_proj" in n)
    x = torch.randn(1, 6, 128, dtype=torch.bfloat16)
    mla(x)[:, -1].float().square().sum().backward()
    want = mla.kv_b_proj.weight.grad.float().clone()
    mla.zero_grad()
    with torch.no_grad():
        warm = LatentCache.from_config(cfg, 1, 8, dtype=torch.bfloat16)
        mla(x[:, :5], warm)
        mla(x[:, 5:], warm)
    cache = LatentCache.from_config(cfg, 1, 8, dtype=torch.bfloat16)
    mla(x[:, :5], cache)
    mla(x[:, 5:], cache)[:, -1].float().square().sum().backward()
    got = mla.kv_b_proj.weight.grad.float()
    assert ((got - want).norm() / want.norm()).item() < 0.02


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_expand_step_has_the_explicit_gradient_in_either_mode(mode):
    """The 'expand' path (the transformers adapter's custom masks and padding queries take it) records
    in eval mode too: its key scalars must come from weights autograd follows (a kept copy left
    kv_b_proj's gradient off by 0.17 relative)."""
    torch.manual_seed(0)
    mla = MLA(CFG).double().train(mode == "train")
    x = torch.randn(2, 6, 64, dtype=torch.double)
    assert_cached_gradient_is_explicit(mla, x, 5, lambda cache: mla(x[:, 5:], cache, path="expand"))


def test_a_training_decode_over_an_evicting_cache_refuses_its_backward():
    """A policy moves rows inside the cache without autograd: the slot's gradient went to the token
    first written there (an evicted token got +0.13, a kept one 0, against finite differences)."""
    from qkmla.cache import StreamingLLM

    torch.manual_seed(0)
    mla = MLA(CFG)
    x = torch.randn(1, 9, 64)
    cache = LatentCache.from_config(CFG, 1, 16, policy=StreamingLLM(sinks=2, budget=6))
    mla(x[:, :8], cache)
    out = mla(x[:, 8:], cache)
    with pytest.raises(RuntimeError, match=r"^cache: an eviction policy moves cached rows without autograd"):
        out.sum().backward()
    with torch.no_grad():
        assert torch.isfinite(mla(x[:, 8:], cache)).all()


def test_a_subclass_overriding_the_query_hook_with_its_own_signature_still_decodes():
    class Scaled(MLA):
        def absorbed_query(self, x, positions):
            q_lat, q_rope = super().absorbed_query(x, positions)
            return q_lat * 2, q_rope

    torch.manual_seed(0)
    mla = Scaled(CFG)
    cache = LatentCache.from_config(CFG, 2, 8)
    mla(torch.randn(2, 5, 64), cache)
    mla(torch.randn(2, 1, 64), cache).sum().backward()
    assert mla.kv_b_proj.weight.grad is not None and "_step_weights" not in vars(mla)


def test_expand_steps_in_a_row_are_trained_through():
    """A second 'expand' step's append overwrote, in place, the cached rows autograd had saved for the
    first step's backward: "modified by an inplace operation". Each step now reads a copy."""
    torch.manual_seed(0)
    mla = MLA(CFG).double()
    x = torch.randn(2, 7, 64, dtype=torch.double)
    assert_cached_gradient_is_explicit(
        mla, x, 5, lambda cache: torch.cat([mla(x[:, t:t + 1], cache, path="expand") for t in (5, 6)], dim=1))
