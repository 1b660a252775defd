"""Eviction through MLA.forward: scores are the layer's real attention, and decoding after an
eviction equals decoding over a cache that only ever held the kept tokens at their positions."""

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig, PagedLayout, QKNormConfig
from qkmla.attention.decode import decode_one_token
from qkmla.cache import H2O, SnapKV, StreamingLLM
from qkmla.cache.scores import attention_probs
from qkmla.rope import YarnScaling
from qkmla.cli.verify import perturb_vectors

VARIANTS = {
    "rms": dict(qk_norm="rms"),
    "rms-unified": dict(qk_norm=QKNormConfig("rms", mode="unified")),
    "plain": dict(qk_norm=None),
    "gqa-learnable-scale": dict(qk_norm=QKNormConfig("rms", learnable_logit_scale=True), num_kv_groups=2),
    "lp3-unified": dict(qk_norm=QKNormConfig("lp", mode="unified", p=3.0)),
}


def make(name: str = "rms", **kw) -> MLA:
    return perturb_vectors(MLA(MLAConfig(**{**VARIANTS[name], **kw}))).double().eval()


def new_cache(mla: MLA, B: int, capacity: int, policy=None, layout: str = "contiguous") -> LatentCache:
    kw = {}
    if layout == "paged":  # shuffled blocks: a sequence's tokens land anywhere in the pool
        per_seq = -(-capacity // 4)
        kw["layout"] = PagedLayout(block_size=4, block_table=torch.randperm(B * per_seq).view(B, per_seq))
    return LatentCache.from_config(mla.config, B, capacity, dtype=torch.float64, fill=float("nan"), policy=policy, **kw)


def explicit_probs(mla: MLA, x: torch.Tensor, positions=None) -> torch.Tensor:
    """softmax of the explicit path's causal logits (materialized, normalized q and k), [B, h, T, T]."""
    return torch.softmax(mla.logits(x, "explicit", positions), dim=-1)


# -- the scores are the layer's attention -------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_attention_probs_equal_the_explicit_paths_softmax(name):
    """From the latent query, the cached latent + RoPE key and the key scalars (blockwise or
    unified), softmax scale included, against softmax(q k^T tau) over materialized keys."""
    mla = make(name)
    B, T = 2, 9
    x = torch.randn(B, T, mla.config.hidden_size, dtype=torch.float64)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        q_lat, q_rope = mla.absorbed_query(x, pos)
        rows = mla.cache_rows(x, pos)
        latent = torch.cat((rows["c_kv"], rows["k_rope"]), dim=-1)
        causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        got = attention_probs(q_lat, q_rope, latent, rows["key_scale"], mla.scale, mla.score_mode, causal)
        want = explicit_probs(mla, x)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
    assert want.amax() > 0.5  # peaked enough that a wrong logit would show


@pytest.mark.parametrize("name", ["rms", "rms-unified", "plain"])
def test_h2o_accumulates_every_real_querys_attention(name):
    """No eviction yet (the budget is the capacity): after a padded prefill of lengths 7 and 4
    and three decode steps, H2O's per-head scores are the explicit attention each token
    received, summed over every real query so far."""
    mla = make(name)
    lengths, steps = [7, 4], 3
    d = mla.config.hidden_size
    streams = [torch.randn(n + steps, d, dtype=torch.float64) for n in lengths]
    cache = new_cache(mla, 2, 12, H2O(budget=12, window=1))
    padded = torch.zeros(2, max(lengths), d, dtype=torch.float64)
    for b, n in enumerate(lengths):
        padded[b, :n] = streams[b][:n]
    with torch.no_grad():
        mla(padded, cache, input_lengths=torch.tensor(lengths))
        for t in range(steps):
            mla(torch.stack([s[n + t] for s, n in zip(streams, lengths)])[:, None], cache)
        for b, n in enumerate(lengths):
            want = explicit_probs(mla, streams[b][None]).sum(dim=2)[0]  # [h, S]
            torch.testing.assert_close(cache.eviction.scores[b, :, :n + steps], want, rtol=1e-12, atol=1e-12)
    assert cache.eviction.steps == steps and cache.seqlens.tolist() == [10, 7]


def test_h2o_evicts_by_attention_accumulated_across_decode_steps():
    """Budget 6, window 2, interval 3: the prefill keeps the 4 prompt tokens that received the
    most attention (explicit path) plus the last 2; three decode steps later, the kept scores
    (moved with their tokens) plus the steps' attention decide again."""
    mla = make("rms-unified")
    x = torch.randn(1, 12, mla.config.hidden_size, dtype=torch.float64)
    cache = new_cache(mla, 1, 12, H2O(budget=6, window=2, interval=3))

    def top(acc: dict, window: int = 2, budget: int = 6) -> list[int]:
        """The kept positions: the last ``window`` and the best of the rest by the mean over heads."""
        positions = sorted(acc)
        rest = sorted(positions[:-window], key=lambda p: -float(acc[p].mean()))
        return sorted(rest[:budget - window] + positions[-window:])

    with torch.no_grad():
        mla(x[:, :8], cache)
        received = explicit_probs(mla, x[:, :8]).sum(dim=2)[0]  # [h, 8]
        acc = {p: received[:, p] for p in range(8)}
        kept = top(acc)
        assert cache.slot_positions()[0].tolist() == kept
        acc = {p: acc[p] for p in kept}
        for t in range(8, 11):
            idx = cache.slot_positions()[0].tolist() + [t]
            mla(x[:, t:t + 1], cache)
            p = explicit_probs(mla, x[:, idx], torch.tensor(idx))[0, :, -1]  # the new query's attention [h, len(idx)]
            acc = {q: acc.get(q, 0) + p[:, i] for i, q in enumerate(idx)}
        kept = top(acc)
    assert cache.slot_positions()[0].tolist() == kept and cache.next_positions.tolist() == [11]
    torch.testing.assert_close(cache.eviction.scores[0, :, :6], torch.stack([acc[q] for q in kept], dim=1),
                               rtol=1e-12, atol=1e-12)


# -- decoding after an eviction --------------------------------------------------------------


POLICIES = {
    "streaming-llm": lambda: StreamingLLM(sinks=2, budget=6),
    "h2o": lambda: H2O(budget=7, window=2, sinks=1),
    "h2o-max-interval2": lambda: H2O(budget=7, window=2, interval=2, head_reduce="max"),
    "snapkv": lambda: SnapKV(budget=6, window=3, kernel_size=3),
    "snapkv-decode-interval3": lambda: SnapKV(kept_fraction=0.5, window=2, interval=3, pooling="max"),
}


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["rms", "rms-unified", "plain"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_decode_after_eviction_equals_decode_over_the_kept_tokens(policy, name, layout):
    """Prompts of lengths 9, 3 and 12 in one padded prefill, then a 3-token chunk, then single
    tokens. Before each call the cache says which positions it kept; the call's outputs must
    equal the explicit path over exactly those tokens at those positions plus the new ones
    (a chunk's tokens see every kept slot and each other causally: visibility is by slot)."""
    check_decode_over_kept_tokens(make(name), POLICIES[policy](), layout)


def test_the_expand_path_evicts_alike():
    check_decode_over_kept_tokens(make("rms"), H2O(budget=7, window=2), "paged", path="expand")


def check_decode_over_kept_tokens(mla: MLA, policy, layout: str, path: str = "auto") -> None:
    lengths, extra = [9, 3, 12], 8
    B, d = len(lengths), mla.config.hidden_size
    streams = [torch.randn(n + extra, d, dtype=torch.float64) for n in lengths]
    cache = new_cache(mla, B, 20, policy, layout)
    padded = torch.zeros(B, max(lengths), d, dtype=torch.float64)
    for b, n in enumerate(lengths):
        padded[b, :n] = streams[b][:n]
    evicted = False
    with torch.no_grad():
        out = mla(padded, cache, input_lengths=torch.tensor(lengths))
        for b, n in enumerate(lengths):  # the prefill itself attends over the whole prompt
            torch.testing.assert_close(out[b, :n], mla(streams[b][None, :n])[0], rtol=1e-10, atol=1e-10)
        for T in (3, 1, 1, 1, 1, 1):
            kept = cache.slot_positions()
            lens, start = cache.seqlens.clone(), cache.next_positions.clone()
            evicted |= bool((lens < start).any())
            chunk = torch.stack([s[int(p):int(p) + T] for s, p in zip(streams, start)])
            out = mla(chunk, cache, path=path)
            for b in range(B):
                idx = kept[b, :lens[b]].tolist() + list(range(int(start[b]), int(start[b]) + T))
                want = mla(streams[b][idx][None], positions=torch.tensor(idx))[0, -T:]
                torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-10, msg=f"sequence {b}, kept {idx}")
    assert evicted and not torch.isnan(out).any()
    assert cache.next_positions.tolist() == [n + extra for n in lengths]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_padded_chunk_after_eviction_sees_the_kept_slots(layout):
    """After evictions, a right-padded chunk (real lengths 2, 0, 3 of 3): each real token sees
    its sequence's kept slots and the chunk's earlier real tokens (visible_lens by slot)."""
    mla = make("rms-unified")
    d = mla.config.hidden_size
    streams = [torch.randn(14, d, dtype=torch.float64) for _ in range(3)]
    cache = new_cache(mla, 3, 16, H2O(budget=5, window=2), layout)
    with torch.no_grad():
        mla(torch.stack([s[:8] for s in streams]), cache, input_lengths=torch.tensor([8, 6, 7]))
        mla(torch.stack([s[int(p)] for s, p in zip(streams, cache.next_positions)])[:, None], cache)
        kept, lens, start = cache.slot_positions(), cache.seqlens.clone(), cache.next_positions.clone()
        assert lens.tolist() == [5, 5, 5] and start.tolist() == [9, 7, 8]
        chunk = torch.stack([s[int(p):int(p) + 3] for s, p in zip(streams, start)])
        out = mla(chunk, cache, input_lengths=torch.tensor([2, 0, 3]))
        for b, n in enumerate([2, 0, 3]):
            idx = kept[b, :lens[b]].tolist() + list(range(int(start[b]), int(start[b]) + n))
            want = mla(streams[b][idx][None], positions=torch.tensor(idx))[0, len(idx) - n:]
            torch.testing.assert_close(out[b, :n], want, rtol=1e-10, atol=1e-10)
    assert cache.next_positions.tolist() == [11, 7, 11] and cache.seqlens.tolist() == [5, 5, 5]


@pytest.mark.parametrize("policy", ["streaming-llm", "h2o", "snapkv"])
def test_a_policy_that_keeps_everything_changes_nothing(policy):
    make_policy = {"streaming-llm": lambda: StreamingLLM(sinks=1, kept_fraction=1.0),
                   "h2o": lambda: H2O(kept_fraction=1.0, window=1),
                   "snapkv": lambda: SnapKV(kept_fraction=1, window=2, interval=1)}[policy]
    mla = make("rms")
    x = torch.randn(2, 12, mla.config.hidden_size, dtype=torch.float64)
    caches = [new_cache(mla, 2, 12), new_cache(mla, 2, 12, make_policy())]
    with torch.no_grad():
        outs = [torch.cat([mla(x[:, :6], c)] + [mla(x[:, t:t + 1], c) for t in range(6, 12)], dim=1) for c in caches]
    assert torch.equal(outs[0], outs[1])
    for name in caches[0].fields:
        assert torch.equal(caches[0].read(name), caches[1].read(name))
    assert caches[1].seqlens.tolist() == [12, 12] and caches[1].eviction.evicted.tolist() == [0, 0]


def test_the_compiled_decode_steps_wrapper_runs_the_policy_too():
    mla = make("rms").float()
    x = torch.randn(2, 10, mla.config.hidden_size)
    caches = [LatentCache.from_config(mla.config, 2, 10, policy=H2O(budget=5, window=2)) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            mla(x[:, :6], cache)
        for t in range(6, 10):
            a = decode_one_token(mla, x[:, t:t + 1], caches[0])
            b = mla(x[:, t:t + 1], caches[1])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert torch.equal(caches[0].slot_positions(), caches[1].slot_positions())
    assert caches[0].seqlens.tolist() == [5, 5]


# -- StreamingLLM's re-positioning --------------------------------------------------------------


ROPES = {
    "interleaved": dict(),
    "half-yarn": dict(rope_interleave=False,
                      rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=0.5,
                                               mscale_all_dim=1.0)),
}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("name", ["rms", "plain"])
def test_repositioned_tokens_equal_tokens_cached_at_their_new_positions(name, rope):
    """StreamingLLM(sinks=2, budget=6, reposition=True): after every step the cache equals one
    built directly from the kept tokens (2 sinks + the newest 4) at positions 0..5, its latent
    and key scalars bit for bit those of the same policy without re-positioning (only the RoPE
    key turns), and the next token, at position 6, decodes as the explicit path over those 7
    tokens at positions 0..6."""
    mla = make(name, **ROPES[rope])
    x = torch.randn(1, 16, mla.config.hidden_size, dtype=torch.float64)
    cache = new_cache(mla, 1, 16, StreamingLLM(sinks=2, budget=6, reposition=True), layout="paged")
    twin = new_cache(mla, 1, 16, StreamingLLM(sinks=2, budget=6))  # same tokens, original positions
    d_c = mla.config.kv_lora_rank
    with torch.no_grad():
        mla(x[:, :9], cache)
        mla(x[:, :9], twin)
        for t in range(9, 16):
            tokens = [0, 1] + list(range(t - 4, t))  # the kept tokens, in order
            assert cache.next_positions.tolist() == [6] and cache.slot_positions()[0].tolist() == list(range(6))
            assert twin.slot_positions()[0].tolist() == tokens
            rows = mla.cache_rows(x[:, tokens], torch.arange(6)[None])
            (latent, key_scale), (twin_latent, twin_scale) = cache.load(), twin.load()
            direct = torch.cat((rows["c_kv"], rows["k_rope"]), dim=-1)
            torch.testing.assert_close(latent, direct, rtol=1e-12, atol=1e-12)
            assert torch.equal(latent[..., :d_c], twin_latent[..., :d_c])
            assert (key_scale is None and twin_scale is None) or torch.equal(key_scale, twin_scale)
            assert not torch.equal(latent[0, 2:, d_c:], twin_latent[0, 2:, d_c:])  # the window's RoPE keys turned
            out = mla(x[:, t:t + 1], cache)
            mla(x[:, t:t + 1], twin)
            want = mla(x[:, tokens + [t]])[:, -1:]  # positions 0..6
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


# -- a step that fails --------------------------------------------------------------------------


def cache_state(cache: LatentCache) -> dict:
    ev = cache.eviction
    return {"seqlens": cache.seqlens.clone(), "next_positions": cache.next_positions.clone(),
            "max_len": cache.max_len, "positions": cache.slot_positions().clone(), "steps": ev.steps,
            "scores": None if ev.scores is None else ev.scores.clone(), "evicted": ev.evicted.clone(),
            **{name: cache.read(name).clone() for name in cache.fields}}  # the rows within each length


def assert_same_state(cache: LatentCache, before: dict) -> None:
    for key, value in cache_state(cache).items():
        if isinstance(value, torch.Tensor):
            assert value.shape == before[key].shape and torch.allclose(value, before[key], rtol=0, atol=0,
                                                                       equal_nan=True), key
        else:
            assert value == before[key], key


@pytest.mark.parametrize("step", ["forward", "decode_one_token"])
@pytest.mark.parametrize("where", ["attending", "scoring", "compacting", "re-positioning"])
def test_a_step_that_fails_leaves_cache_and_policy_as_they_were(where, step, monkeypatch):
    """After evictions, a decode step that fails while attending, while the policy scores the
    slots, compacts its scores or turns the kept RoPE keys (all before a row moves), takes its
    token out again and leaves the rows, the scores and the step count as they were; the retry
    then decodes as a step that never failed. Through ``MLA.forward`` and ``decode_one_token``."""
    import qkmla.attention.decode as decode_module
    import qkmla.attention.mla as mla_module
    import qkmla.cache.evictor as evictor_module

    mla = make("rms")
    x = torch.randn(2, 10, mla.config.hidden_size, dtype=torch.float64)
    policy = (StreamingLLM(sinks=1, budget=5, reposition=True) if where == "re-positioning"
              else H2O(budget=5, window=2))
    caches = [new_cache(mla, 2, 10, policy) for _ in range(2)]
    run = mla if step == "forward" else (lambda x_, cache: decode_one_token(mla, x_, cache))
    with torch.no_grad():
        for cache in caches:
            mla(x[:, :7], cache)
            mla(x[:, 7:8], cache)
        before = cache_state(caches[0])

        def broken(*args, **kwargs):
            raise RuntimeError("out of memory")

        with monkeypatch.context() as m:
            if where == "attending":
                m.setattr(mla_module, "mla_decode_with_kvcache", broken)
                m.setattr(decode_module, "latent_attention_op", broken)
            elif where == "scoring":
                m.setattr(evictor_module, "attention_received", broken)
            elif where == "compacting":
                m.setattr(H2O, "compacted", broken)
            else:
                m.setattr(mla.rotary, "shift", broken)
            with pytest.raises(RuntimeError, match="out of memory"):
                run(x[:, 8:9], caches[0])
        assert_same_state(caches[0], before)
        outs = [run(x[:, 8:9], cache) for cache in caches]
        assert_same_state(caches[0], cache_state(caches[1]))
    assert torch.equal(outs[0], outs[1])


def test_reset_forgets_the_policys_state():
    mla = make("rms")
    x = torch.randn(1, 8, mla.config.hidden_size, dtype=torch.float64)
    cache = new_cache(mla, 1, 8, H2O(budget=4, window=1))
    with torch.no_grad():
        mla(x[:, :6], cache)
        mla(x[:, 6:7], cache)
        cache.reset()
        assert cache.eviction.scores is None and cache.eviction.steps == 0 and cache.eviction.evicted.tolist() == [0]
        torch.testing.assert_close(mla(x[:, :3], cache), mla(x[:, :3]), rtol=1e-10, atol=1e-10)
