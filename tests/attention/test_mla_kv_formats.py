"""MLA decoding over quantized latent caches (fp8, int8, int4): the same attention code reads
them; the key scalars come from the stored latent; batches, pages and NaN fill as for dense."""

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig, PagedLayout, QKNormConfig
from qkmla.attention.decode import decode_one_token, mla_decode_step
from qkmla.ops.statistic import statistic
from qkmla.cli.verify import perturb_vectors

FORMATS = ("fp8", "int8", "int4")
NORMS = {
    "rms": dict(qk_norm="rms"),
    "rms-unified-gqa": dict(qk_norm=QKNormConfig("rms", mode="unified"), num_kv_groups=2),
    "l2": dict(qk_norm=QKNormConfig("l2", learnable_logit_scale=True), softmax_scale=5.0),
    "none": dict(qk_norm=None),
}


def make(norm: str, dtype=torch.float64) -> MLA:
    return perturb_vectors(MLA(MLAConfig(**NORMS[norm]))).to(dtype).eval()


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("kv_format", FORMATS)
def test_absorbed_equals_expand_over_the_same_quantized_cache(kv_format, norm):
    """Prefill and decode steps through the absorbed path (the decode op reads the bytes) and
    through the expand path (keys re-expanded from load()'s dequantized latent and the cached
    scalars) agree to float64 roundoff: both read the same stored rows."""
    mla = make(norm)
    x = torch.randn(2, 11, mla.config.hidden_size, dtype=torch.float64)
    outs = {}
    for path in ("absorbed", "expand"):
        cache = LatentCache.from_config(mla.config, 2, 16, dtype=torch.float64, fill=float("nan"), kv_format=kv_format)
        with torch.no_grad():
            outs[path] = torch.cat([mla(x[:, :6], cache, path=path)] +
                                   [mla(x[:, t:t + 1], cache, path=path) for t in range(6, 11)], dim=1)
    torch.testing.assert_close(outs["absorbed"], outs["expand"], rtol=1e-10, atol=1e-10)
    full = mla(x).detach()
    err = float((outs["absorbed"] - full).norm() / full.norm())
    assert 0 < err < {"fp8": 0.1, "int8": 0.03, "int4": 0.4}[kv_format]  # quantized, and not broken


@pytest.mark.parametrize("kv_format", FORMATS)
def test_key_scalars_are_computed_from_the_stored_latent(kv_format):
    """r = sigma(c^ W_UK) with c^ the latent as stored; sigma(c W_UK) would differ."""
    mla = make("rms")
    x = torch.randn(1, 5, mla.config.hidden_size, dtype=torch.float64)
    cache = LatentCache.from_config(mla.config, 1, 5, dtype=torch.float64, kv_format=kv_format)
    with torch.no_grad():
        mla(x, cache)  # prefill through the explicit path
        c_kv = mla.latent(x)[0]
        w_uk = mla.absorbed.w_uk  # [G, d_n, d_c]
        r_of = lambda c: statistic(torch.einsum("btc,gnc->btgn", c, w_uk), "rms").squeeze(-1)  # noqa: E731
        stored, full = r_of(cache.stored_latent(c_kv)), r_of(c_kv)
    cached = cache.load()[1]
    torch.testing.assert_close(cached, stored, rtol=1e-12, atol=0)
    assert (cached - full).abs().max() > 1e-6 * full.abs().max()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_batch_of_different_lengths_decodes_each_sequence_as_alone(kv_format, layout):
    """Right-padded prompts of lengths 6, 2, 0 and 4, then three steps, over a NaN-filled
    (0xFF bytes) cache, paged with a shuffled table or contiguous: each sequence's outputs equal
    its outputs decoded alone (rows are quantized per token, so a batch changes nothing)."""
    mla = make("rms-unified-gqa")
    lengths, steps, d = [6, 2, 0, 4], 3, mla.config.hidden_size
    B, T = len(lengths), max(lengths)
    prompts = torch.randn(B, T, d, dtype=torch.float64)
    new = torch.randn(B, steps, d, dtype=torch.float64)
    kw = dict(dtype=torch.float64, fill=float("nan"), kv_format=kv_format)
    if layout == "paged":
        kw["layout"] = PagedLayout(block_size=4, block_table=torch.randperm(B * 3).view(B, 3))
    cache = LatentCache.from_config(mla.config, B, T + steps, **kw)
    with torch.no_grad():
        pre = mla(prompts, cache, input_lengths=torch.tensor(lengths))
        dec = torch.cat([mla(new[:, t:t + 1], cache) for t in range(steps)], dim=1)
        for b, n in enumerate(lengths):
            alone = LatentCache.from_config(mla.config, 1, T + steps, dtype=torch.float64, kv_format=kv_format)
            ref = [mla(prompts[b:b + 1, :n], alone)] if n else []
            ref += [mla(new[b:b + 1, t:t + 1], alone) for t in range(steps)]
            ref = torch.cat(ref, dim=1)[0]
            torch.testing.assert_close(torch.cat((pre[b, :n], dec[b])), ref, rtol=1e-10, atol=1e-10)
    assert not pre.isnan().any() and not dec.isnan().any()


@pytest.mark.parametrize("kv_format", ["fp8", "int4"])
def test_compiled_decode_step_over_a_quantized_cache(kv_format):
    """mla_decode_step encodes the new row in the cache's format; compiled (fullgraph), eager
    and MLA.forward write the same bytes and give the same outputs."""
    torch._dynamo.reset()
    mla = make("rms", torch.float32)
    x = torch.randn(2, 8, mla.config.hidden_size)
    step = torch.compile(mla_decode_step, fullgraph=True, backend="aot_eager")
    caches = {how: LatentCache.from_config(mla.config, 2, 12, kv_format=kv_format) for how in ("compiled", "forward")}
    outs = {how: [] for how in caches}
    with torch.no_grad():
        for cache in caches.values():
            mla(x[:, :5], cache)
        for t in range(5, 8):
            outs["compiled"].append(decode_one_token(mla, x[:, t:t + 1], caches["compiled"], step=step))
            outs["forward"].append(mla(x[:, t:t + 1], caches["forward"]))
    torch.testing.assert_close(torch.cat(outs["compiled"], 1), torch.cat(outs["forward"], 1), rtol=1e-5, atol=1e-6)
    for field in caches["forward"].fields:
        assert torch.equal(caches["compiled"].fields[field].data, caches["forward"].fields[field].data), field


@pytest.mark.parametrize("kv_format", FORMATS)
def test_mla_decodes_a_quantized_cache_through_the_kernel(kv_format):
    """decode_backend="triton" (the interpreter on a CPU) gives what the torch backend gives."""
    pytest.importorskip("triton")
    cfg = MLAConfig(hidden_size=64, num_heads=4, num_kv_groups=2, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, qk_norm="rms")
    mla = MLA(cfg).eval()
    x = torch.randn(2, 10, 64)
    outs = {}
    for backend in ("torch", "triton"):
        mla.config = cfg.replace(decode_backend=backend)
        cache = LatentCache.from_config(cfg, 2, 16, fill=float("nan"), kv_format=kv_format,
                                        layout=PagedLayout(block_size=16, block_table=torch.tensor([[2], [0]])))
        with torch.no_grad():
            outs[backend] = torch.cat([mla(x[:, :7], cache)] + [mla(x[:, t:t + 1], cache) for t in range(7, 10)], 1)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-5)
