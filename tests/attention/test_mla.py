
import pytest
import torch

from qkmla import FullKVCache, LatentCache, MLA, MLAConfig, PagedLayout, QKNormConfig
from qkmla.cli.verify import VARIANTS, perturb_vectors, verify_variant

NORM_VARIANTS = {
    "rms": dict(qk_norm="rms"),
    "rms-unified": dict(qk_norm=QKNormConfig("rms", mode="unified")),
    "l2-learnable": dict(qk_norm=QKNormConfig("l2", learnable_logit_scale=True), softmax_scale=5.0),
    "lp1.5": dict(qk_norm=QKNormConfig("lp", p=1.5)),
    "lp3-unified": dict(qk_norm=QKNormConfig("lp", mode="unified", p=3.0)),
    "none": dict(qk_norm=None),
    "gqa": dict(qk_norm="rms", num_kv_groups=2),
    "no-q-lora": dict(qk_norm="rms", q_lora_rank=None),
}


def make(overrides=None, dtype=torch.float64, **kw) -> MLA:
    cfg = MLAConfig(**{**(overrides or {}), **kw})
    return perturb_vectors(MLA(cfg)).to(dtype)


# -- Appendix E: explicit == absorbed --------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_float64_logits_and_outputs_agree_to_roundoff(name):
    row = next(r for r in verify_variant(name, VARIANTS[name]) if r.dtype == "float64")
    assert row.max_abs_logit > 1.0  # logits of a useful size, so the relative bound is not vacuous
    assert row.max_abs_logit_diff <= 1e-10 * row.max_abs_logit
    assert row.max_abs_output_diff <= 1e-10 * row.max_abs_output
    assert row.ok


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_low_precision_absorbed_error_at_most_twice_explicit_error(name, dtype):
    """FlashAttention's rule against a float64 reference, for logits and outputs."""
    row = next(r for r in verify_variant(name, VARIANTS[name]) if r.dtype == dtype)
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert row.explicit_logit_err > 0  # the rule is only meaningful if low precision shows error
    assert row.absorbed_logit_err <= 2 * row.explicit_logit_err + eps * row.max_abs_logit
    assert row.absorbed_output_err <= 2 * row.explicit_output_err + eps * row.max_abs_output
    assert row.ok


def test_absorbed_logits_differ_if_key_scalar_is_dropped():
    """The test above can fail: ignoring r (plain MLA math on QK-normed weights) is caught."""
    mla = make(qk_norm="rms")
    x = torch.randn(1, 9, mla.config.hidden_size, dtype=torch.float64)
    rows = mla.cache_rows(x, torch.arange(9).expand(1, 9))
    q_lat, q_rope = mla.absorbed_query(x, torch.arange(9).expand(1, 9))
    from qkmla.ops.mla_decode.torch_impl import latent_scores

    latent = torch.cat((rows["c_kv"], rows["k_rope"]), dim=-1)
    right = latent_scores(q_lat, q_rope, latent, rows["key_scale"])
    wrong = latent_scores(q_lat, q_rope, latent, torch.ones_like(rows["key_scale"]))
    assert (right - wrong).abs().max() > 1e-2


# -- cache consistency: prefill then decode == full sequence ---------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", list(NORM_VARIANTS))
def test_prefill_then_decode_matches_full_sequence(name, layout):
    mla = make(NORM_VARIANTS[name]).eval()
    B, T, prompt = 3, 13, 5
    x = torch.randn(B, T, mla.config.hidden_size, dtype=torch.float64)
    full = mla(x)
    kw = {}
    if layout == "paged":  # shuffled blocks: sequence b's tokens land anywhere in the pool
        table = torch.randperm(B * 4).view(B, 4)
        kw["layout"] = PagedLayout(block_size=4, block_table=table)
    # Never-written slots hold NaN: any read past a sequence's length poisons the output.
    cache = LatentCache.from_config(mla.config, B, 16, dtype=torch.float64, fill=float("nan"), **kw)
    outs = [mla(x[:, :prompt], cache)]
    for t in range(prompt, T):
        outs.append(mla(x[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.seqlens.tolist() == [T] * B


@pytest.mark.parametrize("path", ["absorbed", "expand"])
def test_chunked_prefill_paths(path):
    mla = make(qk_norm="rms", num_kv_groups=2).eval()
    x = torch.randn(2, 12, mla.config.hidden_size, dtype=torch.float64)
    cache = LatentCache.from_config(mla.config, 2, 12, dtype=torch.float64, fill=float("nan"))
    got = torch.cat([mla(x[:, :4], cache, path=path), mla(x[:, 4:9], cache, path=path), mla(x[:, 9:], cache, path=path)], 1)
    torch.testing.assert_close(got, mla(x), rtol=1e-10, atol=1e-10)


def test_full_key_cache_matches_too():
    mla = make(qk_norm="rms").eval()
    x = torch.randn(2, 10, mla.config.hidden_size, dtype=torch.float64)
    cache = FullKVCache.from_config(mla.config, 2, 10, dtype=torch.float64, fill=float("nan"))
    got = torch.cat([mla(x[:, :6], cache)] + [mla(x[:, t:t + 1], cache) for t in range(6, 10)], 1)
    torch.testing.assert_close(got, mla(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["rms", "rms-unified", "none"])
def test_batch_of_different_lengths(name):
    """Right-padded prompts of lengths 7, 3, 0 and 5 in one prefill, then decode together."""
    mla = make(NORM_VARIANTS[name]).eval()
    lengths = [7, 3, 0, 5]
    B, T, steps = len(lengths), max(lengths), 4
    d = mla.config.hidden_size
    prompts = [torch.randn(1, n, d, dtype=torch.float64) for n in lengths]
    new = torch.randn(B, steps, d, dtype=torch.float64)
    padded = torch.zeros(B, T, d, dtype=torch.float64)
    for b, p in enumerate(prompts):
        padded[b, :lengths[b]] = p[0]
    cache = LatentCache.from_config(mla.config, B, T + steps, dtype=torch.float64, fill=float("nan"))
    pre = mla(padded, cache, input_lengths=torch.tensor(lengths))
    dec = [mla(new[:, t:t + 1], cache) for t in range(steps)]
    assert cache.seqlens.tolist() == [n + steps for n in lengths]
    for b, n in enumerate(lengths):
        ref = mla(torch.cat((prompts[b], new[b:b + 1]), dim=1))  # this sequence alone, no cache
        torch.testing.assert_close(pre[b, :n], ref[0, :n], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(torch.cat([o[b] for o in dec]), ref[0, n:], rtol=1e-10, atol=1e-10)
    assert not torch.isnan(pre).any()


def test_float32_decode_close_to_explicit():
    mla = make(qk_norm="rms", dtype=torch.float32).eval()
    x = torch.randn(2, 20, mla.config.hidden_size)
    cache = LatentCache.from_config(mla.config, 2, 20)
    got = torch.cat([mla(x[:, :10], cache)] + [mla(x[:, t:t + 1], cache) for t in range(10, 20)], 1)
    torch.testing.assert_close(got, mla(x), rtol=1e-4, atol=1e-5)


# -- training path -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(NORM_VARIANTS))
def test_gradients_reach_every_weight(name):
    mla = make(NORM_VARIANTS[name])
    x = torch.randn(2, 7, mla.config.hidden_size, dtype=torch.float64)
    mla(x).square().sum().backward()
    for pname, p in mla.named_parameters():
        assert p.grad is not None, pname
        assert p.grad.abs().sum() > 0, pname
    names = dict(mla.named_parameters())
    if mla.config.has_qk_norm:
        assert {"q_norm.content.weight", "q_norm.rope.weight", "k_norm.content.weight", "k_norm.rope.weight"} <= set(names)


def test_gradcheck_explicit_path():
    mla = make(qk_norm=QKNormConfig("lp", p=3.0), hidden_size=16, num_heads=2, num_kv_groups=1, q_lora_rank=8,
               kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    x = torch.randn(1, 4, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp: mla(inp), (x,))


def decode_last(mla: MLA, x: torch.Tensor) -> torch.Tensor:
    """Prefill all but x's last token into a fresh latent cache, then decode the last one."""
    cache = LatentCache.from_config(mla.config, 1, x.shape[1], dtype=torch.float64)
    mla(x[:, :-1], cache)
    return mla(x[:, -1:], cache)


def test_absorbed_weights_refresh_after_optimizer_step_and_load():
    mla = make(qk_norm="rms").eval()
    x = torch.randn(1, 6, mla.config.hidden_size, dtype=torch.float64)

    before = decode_last(mla, x)
    old = mla.absorbed
    opt = torch.optim.SGD(mla.parameters(), lr=0.1)
    mla(x).sum().backward()
    opt.step()
    assert mla.absorbed is not old  # version counters moved: re-derived on next use
    after = decode_last(mla, x)
    torch.testing.assert_close(after, mla(x)[:, 5:], rtol=1e-10, atol=1e-10)
    assert (after - before).abs().max() > 1e-6

    other = make(qk_norm="rms").eval()
    mla.load_state_dict(other.state_dict())
    torch.testing.assert_close(decode_last(mla, x), other(x)[:, 5:], rtol=1e-10, atol=1e-10)


def test_absorbed_weights_are_cached_while_weights_are_unchanged():
    mla = make(qk_norm="rms").eval()
    assert mla.absorbed is mla.absorbed


def test_absorbed_weights_follow_a_fused_optimizer_and_a_swapped_projection():
    """Fused AdamW updates weights without bumping their version counters: any optimizer step
    drops the kept absorbed weights, in train and in eval mode (a model from from_pretrained is
    in eval mode and DeepSeek has no dropout, so it may be trained there). Swapping kv_b_proj
    (an adapter wrapping it, or merged back through .data) drops them too."""
    mla = make(qk_norm="rms")
    x = torch.randn(2, 6, mla.config.hidden_size, dtype=torch.float64)

    def gap() -> float:
        e, a = mla.logits(x, "explicit"), mla.logits(x, "absorbed")
        finite = torch.isfinite(e)
        return float((e[finite] - a[finite]).abs().max() / e[finite].abs().max())

    for mode in (True, False):
        mla.train(mode)
        assert gap() < 1e-10 and mla.absorbed is mla.absorbed  # derived, then kept
        mla(x).square().mean().backward()
        torch.optim.AdamW(mla.parameters(), lr=0.1, fused=True).step()  # no mode switch
        mla.zero_grad()
        assert gap() < 1e-10
    mla.eval()
    gap()
    old = mla.kv_b_proj
    wrapper = torch.nn.Sequential(old)
    mla.kv_b_proj = wrapper  # what an adapter does: refused, not the weights kept from before
    with pytest.raises(ValueError, match=r"kv_b_proj: the absorbed path reads kv_b_proj.weight, but this kv_b_proj "
                                         r"is a torch\.nn\.modules\.container\.Sequential, whose"):
        gap()
    with pytest.raises(ValueError, match=r"kv_b_proj: the absorbed path .* is a torch\.nn\.modules\.container"):
        mla.refresh_absorbed()  # review 15c: AttributeError on the wrapper's .weight, before the check

    class Scaled(torch.nn.Linear):  # loralib's and bitsandbytes' pattern: an nn.Linear with a forward of its own
        def forward(self, h):
            return 2 * super().forward(h)

    scaled = Scaled(old.in_features, old.out_features, bias=old.bias is not None).to(old.weight.dtype)
    with torch.no_grad():
        scaled.weight.copy_(old.weight)
    mla.kv_b_proj = scaled  # passed the isinstance check, and the absorbed path read .weight alone
    with pytest.raises(ValueError, match=r"but this kv_b_proj is a .*Scaled, whose output is not x @ weight\.T"):
        gap()
    mla.kv_b_proj = None
    with pytest.raises(ValueError, match=r"kv_b_proj: expected an nn\.Linear \(the latent's up-projection\), got "
                                         r"NoneType"):
        mla.absorbed
    parametrized = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None).to(old.weight.dtype)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", torch.nn.Identity())
    with torch.no_grad():
        parametrized.parametrizations.weight.original.copy_(old.weight)
    mla.kv_b_proj = parametrized  # a parametrized Linear keeps nn.Linear's forward: taken
    assert gap() < 1e-10
    with torch.no_grad():
        old.weight.data.mul_(1.5)  # merged through .data, which no version counter sees
    mla.kv_b_proj = old
    assert gap() < 1e-10


def test_absorbed_weights_fold_both_norm_weights():
    mla = make(qk_norm="rms")
    c = mla.config
    w = mla.kv_b_proj.weight.view(c.num_kv_groups, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    torch.testing.assert_close(mla.absorbed.w_uk, w[:, :c.qk_nope_head_dim])
    torch.testing.assert_close(mla.absorbed.w_uv, w[:, c.qk_nope_head_dim:])
    torch.testing.assert_close(mla.absorbed.gamma_qk, mla.q_norm.content.weight * mla.k_norm.content.weight)
    assert make(qk_norm=None).absorbed.gamma_qk is None


@pytest.mark.parametrize("mode", ["blockwise", "unified", "content"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("kind", ["rms", "l2", "lp"])
def test_key_scalars_are_the_key_norms_statistic(kind, groups, mode):
    """The absorbed form's key scalar of each group is the k_norm statistic of that group's
    explicit content key c W_UK^(g) (with the RoPE block's moment in unified mode), for
    batch 2, 3 tokens, G <= h; the stored RoPE key is the explicit one before RoPE (blockwise)."""
    from qkmla.attention.absorbed import key_scalars

    mla = make(qk_norm=QKNormConfig(kind, mode=mode, p=3.0), num_kv_groups=groups)
    c = mla.config
    x = torch.randn(2, 3, c.hidden_size, dtype=torch.float64)
    c_kv, k_r = mla.latent(x)
    k_rope, key_scale = key_scalars(c_kv, k_r, mla.k_norm, mla.absorbed)
    k_c = mla.kv_b_proj(c_kv).view(2, 3, groups, -1)[..., :c.qk_nope_head_dim]
    want, _ = mla.k_norm.statistics(k_c, k_r)
    torch.testing.assert_close(key_scale, want.squeeze(-1), rtol=1e-12, atol=1e-12)
    if mode == "blockwise":
        torch.testing.assert_close(k_rope, mla.k_norm.rope(k_r), rtol=1e-12, atol=1e-12)
    else:  # the scalar scales the whole logit; the stored RoPE key keeps its weight only
        torch.testing.assert_close(k_rope, k_r * mla.k_norm.rope.weight, rtol=1e-12, atol=1e-12)
    assert key_scale.shape == (2, 3, groups) and key_scale.std() > 1e-3  # per-group scalars that differ


@pytest.mark.parametrize("mode", ["blockwise", "content"])
@pytest.mark.parametrize("kind", ["rms", "lp"])
def test_key_scalars_from_the_latent_through_the_cpu_kernel_match_the_gemms(kind, mode):
    """In bfloat16 on a CPU with the kernel, the scalars come from the kernel's statistic of each
    group over W_UK itself (``latent_key_scalars``, no packed copy); they equal the statistic of
    F.linear's bfloat16 content keys to the two products' summation order."""
    from qkmla.attention.absorbed import content_key_scalars, latent_key_scalars
    from qkmla.ops.small_linear import group_kernel_takes, kernel_unavailable

    if kernel_unavailable() is not None:
        pytest.skip(kernel_unavailable())
    mla = make(qk_norm=QKNormConfig(kind, mode=mode, p=3.0), num_kv_groups=2, dtype=torch.bfloat16)
    w = mla.absorbed
    assert w.uk.packed is None and group_kernel_takes(w.w_uk)
    c_kv = torch.randn(2, 5, mla.config.kv_lora_rank).bfloat16()
    G, d_n, d_c = w.w_uk.shape
    k_c = torch.nn.functional.linear(c_kv, w.w_uk.reshape(G * d_n, d_c)).unflatten(-1, (G, d_n))
    got = latent_key_scalars(c_kv, mla.k_norm, w)
    assert got.dtype == torch.float32 and got.shape == (2, 5, G)
    torch.testing.assert_close(got, content_key_scalars(k_c, mla.k_norm), rtol=2e-3, atol=0)


@pytest.mark.parametrize("settings", [dict(mode="unified"), dict(scope="projection")])
def test_key_scalars_that_read_more_than_the_latent_are_not_formed_from_it(settings):
    """A unified statistic reads the RoPE key, a projection-scope one every head: the latent
    alone does not give them (None), and key_scalars forms them from both keys."""
    from qkmla.attention.absorbed import latent_key_scalars, reads_content_only

    mla = make(qk_norm=QKNormConfig("rms", **settings))
    assert not reads_content_only(mla.k_norm)
    assert latent_key_scalars(torch.randn(1, 2, mla.config.kv_lora_rank, dtype=torch.float64), mla.k_norm,
                              mla.absorbed) is None


@pytest.mark.parametrize("which", ["q_norm", "k_norm"])
def test_decode_follows_a_rope_norm_weight_change(which):
    """The decode step reads the RoPE norm weights from the absorbed weights: changing one
    in place must re-derive them (the cache is refilled: it holds normalized RoPE keys)."""
    mla = make(qk_norm="rms").eval()
    x = torch.randn(1, 6, mla.config.hidden_size, dtype=torch.float64)

    before = decode_last(mla, x)
    stale = mla.absorbed
    with torch.no_grad():
        getattr(mla, which).rope.weight.mul_(1.5)
    assert mla.absorbed is not stale
    after = decode_last(mla, x)
    torch.testing.assert_close(after, mla(x)[:, 5:], rtol=1e-10, atol=1e-10)
    assert (after - before).abs().max() > 1e-6


def test_latent_cache_write_discards_content_keys():
    """A cache write stores d_c + d_r values and G scalars per token, nothing of size G * d_n."""
    mla = make(qk_norm="rms")
    cache = LatentCache.from_config(mla.config, 1, 8, dtype=torch.float64)
    mla(torch.randn(1, 3, mla.config.hidden_size, dtype=torch.float64), cache)
    c = mla.config
    assert {n: b.width for n, b in cache.fields.items()} == {"latent": c.kv_lora_rank + c.qk_rope_head_dim,
                                                            "key_scale": c.num_kv_groups}


# -- bad input ----------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors_naming_the_argument():
    mla = make(qk_norm="rms", dtype=torch.float32)
    d = mla.config.hidden_size
    with pytest.raises(ValueError, match=r"x: expected shape"):
        mla(torch.randn(2, 5, d + 1))
    with pytest.raises(ValueError, match=r"x: expected shape"):
        mla(torch.randn(5, d))
    with pytest.raises(ValueError, match=r"x: dtype torch.float64"):
        mla(torch.randn(2, 5, d, dtype=torch.float64))
    with pytest.raises(ValueError, match="x: expected a torch.Tensor"):
        mla([[0.0] * d])
    with pytest.raises(ValueError, match="path"):
        mla(torch.randn(1, 2, d), path="fast")
    with pytest.raises(ValueError, match="path"):
        mla(torch.randn(1, 2, d), path="absorbed")  # no cache to read
    with pytest.raises(ValueError, match="positions"):
        mla(torch.randn(1, 2, d), positions=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="positions"):
        mla(torch.randn(1, 2, d), positions=torch.tensor([0, 1, 2]))


def test_positions_past_capacity():
    mla = make(qk_norm="rms", dtype=torch.float32)
    cache = LatentCache.from_config(mla.config, 2, 8)
    mla(torch.randn(2, 6, mla.config.hidden_size), cache)
    with pytest.raises(ValueError, match=r"positions: .*past the cache capacity=8"):
        mla(torch.randn(2, 3, mla.config.hidden_size), cache)
    assert cache.seqlens.tolist() == [6, 6]  # the failed call wrote nothing


def test_batch_not_matching_cache():
    mla = make(qk_norm="rms", dtype=torch.float32)
    d = mla.config.hidden_size
    cache = LatentCache.from_config(mla.config, 2, 8)
    with pytest.raises(ValueError, match="batch_size=2"):
        mla(torch.randn(3, 1, d), cache)
    mla(torch.randn(2, 3, d), cache)
    with pytest.raises(ValueError, match=r"positions: .*cache lengths \[3, 3\]"):
        mla(torch.randn(2, 1, d), cache, positions=torch.tensor([[5], [3]]))
    with pytest.raises(ValueError, match="input_lengths"):
        mla(torch.randn(2, 2, d), cache, input_lengths=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="input_lengths"):
        mla(torch.randn(2, 2, d), cache, input_lengths=torch.tensor([1]))
    mla(torch.randn(2, 1, d), cache, positions=torch.tensor([[3], [3]]))  # correct positions are accepted


def test_cache_of_wrong_shape():
    mla = make(qk_norm="rms", dtype=torch.float32)
    plain = LatentCache.from_config(mla.config.replace(qk_norm=None), 1, 4)
    with pytest.raises(ValueError, match="cache: LatentCache"):
        mla(torch.randn(1, 1, mla.config.hidden_size), plain)
    with pytest.raises(ValueError, match="cache: expected"):
        mla(torch.randn(1, 1, mla.config.hidden_size), cache={"k": 1})
    full = FullKVCache(1, 4, num_kv_heads=1, k_dim=3, v_dim=3)
    with pytest.raises(ValueError, match="cache: FullKVCache"):
        mla(torch.randn(1, 1, mla.config.hidden_size), full)


def test_explicit_path_with_filled_latent_cache_is_refused():
    mla = make(qk_norm="rms", dtype=torch.float32)
    cache = LatentCache.from_config(mla.config, 1, 8)
    mla(torch.randn(1, 3, mla.config.hidden_size), cache)
    with pytest.raises(ValueError, match="path: 'explicit'"):
        mla(torch.randn(1, 2, mla.config.hidden_size), cache, path="explicit")


def test_config_type_checked():
    with pytest.raises(ValueError, match="config"):
        MLA({"hidden_size": 64})


# -- a decode step is a transaction ------------------------------------------------------


def cache_state(cache: LatentCache) -> dict:
    """Lengths and every stored value (NaN included) of a cache, copied."""
    return {"seqlens": cache.seqlens.clone(), "max_len": cache.max_len,
            **{name: buf.data.clone() for name, buf in cache.fields.items()}}


def assert_same_state(cache: LatentCache, before: dict) -> None:
    for key, value in cache_state(cache).items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True, msg=key)
        else:
            assert value == before[key], key


def test_a_backend_that_cannot_run_fails_before_the_cache_is_written(monkeypatch):
    """decode_backend="triton" on CPU tensors without Triton's interpreter (or with widths the
    kernel does not take) is refused before the token is appended, so a retry on a backend
    that runs attends to the token once and gives the explicit path's output."""
    kernel_widths = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, kv_lora_rank=32, decode_backend="triton")
    mla = make(kernel_widths, dtype=torch.float32).eval()
    x = torch.randn(2, 6, mla.config.hidden_size)
    cache = LatentCache.from_config(mla.config, 2, 8, fill=float("nan"))
    mla(x[:, :5], cache)  # an explicit prefill: no decode op involved
    before = cache_state(cache)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend: 'triton' runs on CUDA tensors"):
        mla(x[:, 5:], cache)
    assert_same_state(cache, before)
    monkeypatch.undo()
    narrow = make(dict(kernel_widths, qk_rope_head_dim=8), dtype=torch.float32).eval()
    narrow_cache = LatentCache.from_config(narrow.config, 2, 8, fill=float("nan"))
    narrow(x[:, :5], narrow_cache)
    narrow_before = cache_state(narrow_cache)
    with pytest.raises(ValueError, match="powers of two"):
        narrow(x[:, 5:], narrow_cache)
    assert_same_state(narrow_cache, narrow_before)
    mla.config = mla.config.replace(decode_backend="torch")
    with torch.no_grad():
        torch.testing.assert_close(mla(x[:, 5:], cache), mla(x)[:, 5:], rtol=1e-5, atol=1e-5)


def test_a_step_that_fails_while_attending_takes_its_token_out_again(monkeypatch):
    import qkmla.attention.mla as mla_module

    mla = make(qk_norm="rms").eval()
    x = torch.randn(2, 6, mla.config.hidden_size, dtype=torch.float64)
    cache = LatentCache.from_config(mla.config, 2, 8, dtype=torch.float64, fill=float("nan"))
    mla(x[:, :5], cache)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed")

    with monkeypatch.context() as m:
        m.setattr(mla_module, "mla_decode_with_kvcache", broken)
        with pytest.raises(RuntimeError, match="kernel launch failed"):
            mla(x[:, 5:], cache)
    assert cache.seqlens.tolist() == [5, 5] and cache.max_len == 5 and cache.next_positions.tolist() == [5, 5]
    torch.testing.assert_close(mla(x[:, 5:], cache), mla(x)[:, 5:], rtol=1e-10, atol=1e-10)


def test_auto_settles_on_torch_when_the_rows_written_carry_gradients(monkeypatch):
    """MLA resolves "auto" before it writes the cache; the new token's rows carry autograd
    (here only the latent projection trains, so the queries carry none), which the cache then
    holds, so "auto" must settle on the torch backend rather than hand the CPU kernel a cache
    it cannot differentiate. Under no_grad the same step picks the CPU kernel (made to look
    available here)."""
    import qkmla.attention.mla as mla_module
    import qkmla.ops.mla_decode.backends as backends

    monkeypatch.setattr(backends, "cpu_unsupported_for", lambda *args, **kwargs: None)
    chosen = []
    real = mla_module.mla_decode_with_kvcache

    def recording(*args, backend, **kwargs):
        chosen.append(backend)
        return real(*args, backend="torch", **kwargs)

    monkeypatch.setattr(mla_module, "mla_decode_with_kvcache", recording)
    mla = make(dict(qk_norm="rms", qk_rope_head_dim=16, qk_nope_head_dim=16, kv_lora_rank=32),
               dtype=torch.bfloat16)
    for name, weight in mla.named_parameters():  # only the latent projection trains: the
        weight.requires_grad_(name.startswith("kv_a_proj_with_mqa"))  # queries carry no autograd
    x = torch.randn(2, 6, mla.config.hidden_size, dtype=torch.bfloat16)
    for grad in (True, False):
        cache = LatentCache.from_config(mla.config, 2, 8, dtype=torch.bfloat16)
        with torch.no_grad():
            mla(x[:, :5], cache)
        with torch.set_grad_enabled(grad):
            out = mla(x[:, 5:], cache)
        assert out.requires_grad == grad and cache.decode_view()["kv_cache"].requires_grad == grad
    assert chosen == ["torch", "cpu"]


@pytest.mark.parametrize("path", ["absorbed", "expand"])
def test_a_new_token_is_rotated_at_its_position_and_stored_at_its_slot(path):
    """Five cached tokens at positions 0..4, then a token at position 7 (as if positions 5
    and 6 had been dropped) lands in slot 5 and equals the explicit path over positions
    [0, 1, 2, 3, 4, 7]."""
    mla = make(qk_norm="rms").eval()
    x = torch.randn(1, 6, mla.config.hidden_size, dtype=torch.float64)
    cache = LatentCache.from_config(mla.config, 1, 8, dtype=torch.float64, fill=float("nan"))
    mla(x[:, :5], cache)
    cache.next_positions = cache.next_positions + 2
    got = mla(x[:, 5:], cache, path=path)
    want = mla(x, positions=torch.tensor([0, 1, 2, 3, 4, 7]))[:, 5:]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert cache.seqlens.tolist() == [6] and cache.next_positions.tolist() == [8]


# -- issue 27, class 3: no silent wrong answers -----------------------------------------------

@pytest.mark.parametrize("kv_format", ["dense", "int8"])
@pytest.mark.parametrize("path", ["auto", "absorbed", "expand"])
@pytest.mark.parametrize("cache_kind", ["latent", "full"])
def test_what_the_padding_holds_never_reaches_a_real_token(path, kv_format, cache_kind):
    """Right padding (past input_lengths) full of NaN, inf or huge values: every real token's
    output, and the decode step after it, equal those with zero padding, on every path."""
    if cache_kind == "full" and (path != "auto" or kv_format != "dense"):
        pytest.skip("a FullKVCache has one path and one format")
    mla = make(qk_norm="rms").eval()
    x = torch.randn(3, 6, mla.config.hidden_size, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 4])
    outs = []
    for fill in (0.0, float("nan"), float("inf"), 1e300):
        xp = x.clone()
        for b, n in enumerate(lengths.tolist()):
            xp[b, n:] = fill
        if cache_kind == "latent":
            cache = LatentCache.from_config(mla.config, 3, 8, dtype=torch.float64, kv_format=kv_format)
        else:
            cache = FullKVCache.from_config(mla.config, 3, 8, dtype=torch.float64)
        pre = mla(xp, cache, input_lengths=lengths, path=path)
        dec = mla(x[:, :1], cache, path="auto" if path == "auto" else "expand" if path == "expand" else "absorbed")
        real = torch.cat([pre[b, :n] for b, n in enumerate(lengths.tolist())] + [dec.flatten(0, 1)])
        assert not real.isnan().any(), fill
        outs.append(real)
    for got in outs[1:]:
        torch.testing.assert_close(got, outs[0], rtol=0, atol=0)


def test_the_structure_of_a_built_module_is_fixed():
    """Assigning a config that changes the norm, its mode or a width is refused (the weights and
    the absorbed path would silently disagree); decode_backend, a setting of how the same
    function runs, may change."""
    mla = make(qk_norm="rms").eval()
    x = torch.randn(1, 4, mla.config.hidden_size, dtype=torch.float64)
    before = mla(x)
    for change in (dict(qk_norm=QKNormConfig("rms", mode="unified")), dict(qk_norm="l2"),
                   dict(qk_norm=QKNormConfig("rms", eps=1e-3)),
                   dict(softmax_scale=0.5), dict(rope_theta=500.0)):
        with pytest.raises(ValueError, match=rf"config: \['{next(iter(change))}'\] are fixed when the module is built"):
            mla.config = mla.config.replace(**change)
    mla.config = mla.config.replace(decode_backend="naive")
    assert mla.decode_backend == "naive" and mla.config.qk_norm.mode == "blockwise"
    torch.testing.assert_close(mla(x), before, rtol=0, atol=0)


@pytest.mark.parametrize("saved,loaded", [
    (dict(qk_norm="rms"), dict(qk_norm=QKNormConfig("rms", mode="unified"))),
    (dict(qk_norm=QKNormConfig("rms", mode="unified")), dict(qk_norm="rms")),
    (dict(qk_norm="rms"), dict(qk_norm="l2")),
    (dict(qk_norm=QKNormConfig("lp", p=3.0)), dict(qk_norm=QKNormConfig("lp", p=4.0))),
])
def test_a_state_of_another_norm_variant_is_refused_though_the_shapes_match(saved, loaded):
    state = make(**saved).state_dict()
    target = make(**loaded)
    with pytest.raises(ValueError, match=r"state_dict: q_norm\._extra_state says these weights belong to a .* QK norm"):
        target.load_state_dict(state)
    make(**saved).load_state_dict(state)  # its own variant loads
    # A state saved before the record existed (or by another library) loads as it always did.
    target.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")})


def test_traced_forward_over_a_cache_matches_eager():
    """torch.jit.trace (and the legacy ONNX export built on it) passes shapes as 0-d tensors: the
    cache's size checks take them as they are (an early check refused num_tokens=tensor(3))."""
    torch.manual_seed(0)
    cfg = MLAConfig(hidden_size=32, num_heads=2, num_kv_groups=2, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, qk_norm=QKNormConfig(kind="rms"), decode_backend="torch")
    mla = MLA(cfg).eval()

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mla = mla

        def forward(self, x):
            return self.mla(x, LatentCache.from_config(cfg, 2, 16))

    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        traced = torch.jit.trace(WithCache(), x, check_trace=False)
        torch.testing.assert_close(traced(x), WithCache()(x))
