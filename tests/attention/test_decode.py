"""The decode step as a plain function: torch.compile(fullgraph=True) captures it on the CPU, and
compiled, eager step function and MLA.forward agree on a tiny config."""

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig, PagedLayout, QKNormConfig
from qkmla.attention.decode import decode_one_token, mla_decode_step
from qkmla.ops.mla_decode.torch_impl import latent_attention, latent_attention_op
from qkmla.cli.verify import perturb_vectors

CONFIGS = {
    "rms-learnable-scale": dict(qk_norm=QKNormConfig("rms", learnable_logit_scale=True)),
    "unified-gqa": dict(qk_norm=QKNormConfig("rms", mode="unified"), num_kv_groups=2),
    "lp3": dict(qk_norm=QKNormConfig("lp", p=3.0)),
    "plain": dict(qk_norm=None),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_decode_step_equals_eager(name):
    torch._dynamo.reset()
    cfg = MLAConfig(**CONFIGS[name])
    mla = perturb_vectors(MLA(cfg)).eval()
    x = torch.randn(2, 8, cfg.hidden_size)
    # fullgraph=True: any graph break is an error. aot_eager traces through AOTAutograd (the
    # in-place cache writes are functionalized) without the minutes of C++ codegen inductor
    # needs on a small CPU; inductor compiles the same graph.
    step = torch.compile(mla_decode_step, fullgraph=True, backend="aot_eager")
    caches = {how: LatentCache.from_config(cfg, 2, 12) for how in ("compiled", "function", "forward")}
    outs = {how: [] for how in caches}
    with torch.no_grad():
        for cache in caches.values():
            mla(x[:, :5], cache)  # prefill through the explicit path
        for t in range(5, 8):
            outs["compiled"].append(decode_one_token(mla, x[:, t:t + 1], caches["compiled"], step=step))
            outs["function"].append(decode_one_token(mla, x[:, t:t + 1], caches["function"]))
            outs["forward"].append(mla(x[:, t:t + 1], caches["forward"]))
        want = mla(x)[:, 5:]
    got = {how: torch.cat(o, dim=1) for how, o in outs.items()}
    torch.testing.assert_close(got["compiled"], got["function"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["function"], got["forward"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["forward"], want, rtol=1e-4, atol=1e-5)
    for cache in caches.values():
        assert cache.seqlens.tolist() == [8, 8] and cache.next_positions.tolist() == [8, 8] and cache.max_len == 8
    for field in caches["forward"].fields:
        torch.testing.assert_close(caches["compiled"].fields[field].data, caches["forward"].fields[field].data,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
@pytest.mark.parametrize("lengths", [(9, 4), (9, 9), (0, 0), (0, 3)])
def test_latent_attention_op_is_the_core_over_the_visible_prefix(mode, lengths):
    """The compiled step calls the torch backend's core as one opaque op, handing it buffers of
    12 slots and each sequence's visible length: the op reads only up to the longest one
    (slots past it may hold NaN, and so may a shorter sequence's unused slots) and equals
    the core over that prefix with a mask (none when every query sees every slot)."""
    gen = torch.Generator().manual_seed(1)
    q_lat, q_rope = torch.randn(2, 1, 4, 16, generator=gen), torch.randn(2, 1, 4, 8, generator=gen)
    latent, key_scale = torch.randn(2, 12, 24, generator=gen), torch.rand(2, 12, 2, generator=gen) + 0.5
    for b, n in enumerate(lengths):
        latent[b, n:], key_scale[b, n:] = float("nan"), float("nan")
    visible = torch.tensor(lengths)[:, None]
    args = (q_lat, q_rope, latent, key_scale, 0.3, visible, mode)
    torch.library.opcheck(torch.ops.qkmla.latent_attention, args)
    out, lse = latent_attention_op(*args)
    assert out.is_contiguous() and not out.isnan().any()
    n = max(lengths)
    if n == 0:
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
        return
    mask = None if min(lengths) == n else torch.arange(n) < visible[..., None]
    clean = latent[:, :n].nan_to_num(0.0), key_scale[:, :n].nan_to_num(0.0)
    want_out, want_lse = latent_attention(q_lat, q_rope, *clean, 0.3, mask, mode, return_lse=True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("visible", [torch.tensor([3, 4]), torch.tensor([[3]]), torch.tensor([[3], [13]]),
                                     torch.tensor([[3], [-1]]), torch.tensor([[3.0], [4.0]])])
def test_latent_attention_op_refuses_bad_visible_lens(visible):
    """[B] or [1, T] lengths, counts past the capacity or below 0, or floats: a ValueError naming
    the argument, not an index error or a silent broadcast."""
    q_lat, q_rope = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 8)
    latent, key_scale = torch.randn(2, 12, 24), torch.rand(2, 12, 2)
    with pytest.raises(ValueError, match=r"visible_lens: expected an integer tensor \[B=2, T=1\] of slot counts in \[0, 12\]"):
        latent_attention_op(q_lat, q_rope, latent, key_scale, 0.3, visible, "blockwise")


def test_decode_one_token_refuses_what_it_does_not_cover():
    cfg = MLAConfig()
    mla = MLA(cfg).eval()
    paged = LatentCache.from_config(cfg, 1, 8, layout=PagedLayout(block_size=4))
    with pytest.raises(ValueError, match="cache: decode_one_token needs a contiguous LatentCache"):
        decode_one_token(mla, torch.randn(1, 1, cfg.hidden_size), paged)
    cache = LatentCache.from_config(cfg, 1, 8)
    with pytest.raises(ValueError, match=r"x: expected one new token per sequence"):
        decode_one_token(mla, torch.randn(1, 2, cfg.hidden_size), cache)
    full = LatentCache.from_config(cfg, 1, 1)
    decode_one_token(mla, torch.randn(1, 1, cfg.hidden_size), full)
    with pytest.raises(ValueError, match="capacity=1"):
        decode_one_token(mla, torch.randn(1, 1, cfg.hidden_size), full)


def test_the_step_called_directly_under_autograd_refuses_its_backward_in_words():
    """The backward of mla_decode_step called where autograd records it failed in torch: "no autograd formula
    was registered" for the opaque op. Its forward stays as it was; the backward says what the step is."""
    cfg = MLAConfig()
    mla = MLA(cfg).eval()
    cache = LatentCache.from_config(cfg, 2, 8)
    x = torch.randn(2, 1, cfg.hidden_size, requires_grad=True)
    args = (mla.absorbed, cache.fields["latent"].data, cache.fields["key_scale"].data, torch.tensor([0, 0]),
            torch.tensor([0, 0]))
    out = mla_decode_step(mla, x, *args)
    with torch.no_grad():
        torch.testing.assert_close(out, mla_decode_step(mla, x, *args), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"mla_decode_step\) is inference only .* call the layer, mla\(x, cache\)"):
        out.sum().backward()


@pytest.mark.parametrize("kv_format", ["dense", "fp8", "int8", "int4"])
def test_compiled_decode_step_with_inductor_at_batch_sizes_1_2_3(kv_format):
    """torch.compile's default backend (inductor), as docs/guide.md writes the step, at batch sizes
    3, 2 and 1 through one compiled function: 3 is a static graph whose absorbed query is not
    contiguous (inductor checks the op's outputs against the strides its fake promises), 2
    recompiles with a dynamic batch and 1 specializes again. Each equals MLA.forward over an
    uneven batch. Caches are off, so a graph compiled by an earlier version cannot stand in."""
    torch._dynamo.reset()
    cfg = MLAConfig(hidden_size=32, num_heads=2, num_kv_groups=2, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, qk_norm="rms")
    mla = perturb_vectors(MLA(cfg)).eval()
    step = torch.compile(mla_decode_step, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        for B in (3, 2, 1):
            x = torch.randn(B, 6, cfg.hidden_size)
            caches = [LatentCache.from_config(cfg, B, 8, kv_format=kv_format, fill=float("nan")) for _ in range(2)]
            lengths = torch.arange(B) + 2  # uneven prompts, right-padded to 5 tokens
            for cache in caches:
                mla(x[:, :5], cache, input_lengths=lengths)
            got = decode_one_token(mla, x[:, 5:6], caches[0], step=step)
            want = mla(x[:, 5:6], caches[1])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert not got.isnan().any()
            assert torch.equal(caches[0].seqlens, lengths + 1)
