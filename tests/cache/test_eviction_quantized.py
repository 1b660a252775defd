"""Eviction over a quantized latent cache: compaction keeps each kept token's stored row (codes,
scales, RoPE key, key scalars) bit for bit, and decoding after an eviction equals the decode op
over exactly those rows; re-positioning turns only the RoPE key."""

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig, PagedLayout, QKNormConfig
from qkmla.attention.absorbed import values_out
from qkmla.cache import H2O, SnapKV, StreamingLLM
from qkmla.ops.mla_decode import mla_decode_with_kvcache
from qkmla.cli.verify import perturb_vectors

POLICIES = {
    "streaming-llm": lambda: StreamingLLM(sinks=2, budget=6),
    "h2o": lambda: H2O(budget=7, window=2, sinks=1),
    "snapkv": lambda: SnapKV(budget=6, window=3, kernel_size=3),
}


def make(name: str = "rms") -> MLA:
    kw = dict(qk_norm="rms") if name == "rms" else dict(qk_norm=QKNormConfig("rms", mode="unified"), num_kv_groups=2)
    return perturb_vectors(MLA(MLAConfig(**kw))).double().eval()


def quantized_cache(mla: MLA, kv_format: str, policy=None, paged: bool = False) -> LatentCache:
    kw = dict(layout=PagedLayout(block_size=4, block_table=torch.randperm(4).view(1, 4))) if paged else {}
    return LatentCache.from_config(mla.config, 1, 16, dtype=torch.float64, fill=float("nan"), kv_format=kv_format,
                                   policy=policy, **kw)


@pytest.mark.parametrize("name", ["rms", "unified-gqa"])
@pytest.mark.parametrize("kv_format", ["fp8", "int4"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_decode_after_eviction_reads_the_kept_rows_as_stored(policy, kv_format, name):
    mla = make(name)
    x = torch.randn(1, 16, mla.config.hidden_size, dtype=torch.float64)
    cache = quantized_cache(mla, kv_format, POLICIES[policy](), paged=True)
    twin = quantized_cache(mla, kv_format)  # every token, no policy
    evicted = False
    with torch.no_grad():
        mla(x[:, :9], cache)
        mla(x[:, :9], twin)
        for t in range(9, 16):
            n = int(cache.seqlens[0])
            kept = cache.slot_positions()[0, :n].tolist()
            evicted |= n < t
            for field in cache.fields:  # compaction moved the stored bytes, untouched
                assert torch.equal(cache.read(field)[0, :n], twin.read(field)[0, kept]), field
            out = mla(x[:, t:t + 1], cache)
            mla(x[:, t:t + 1], twin)
            idx = kept + [t]
            q_lat, q_rope = mla.absorbed_query(x[:, t:t + 1], torch.tensor([[t]]))
            o_lat, _ = mla_decode_with_kvcache(
                q_lat, q_rope, twin.read("latent")[:, idx].contiguous(), None, torch.tensor([len(idx)]),
                twin.read("key_scale")[:, idx].contiguous(), softmax_scale=mla.scale, mode=mla.score_mode,
                kv_format=kv_format)
            want = mla.o_proj(values_out(o_lat, mla.absorbed).flatten(2))
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert evicted and not out.isnan().any()


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "int4"])
def test_repositioning_is_refused_where_the_rope_key_is_stored_in_16_bits(kv_format):
    """StreamingLLM(reposition=True) re-rotates and re-stores every kept RoPE key at each
    eviction; in bfloat16 (every quantized format, a bf16 dense cache) the rounding piles up
    step after step, so such a cache refuses it when it is built."""
    mla = make()
    with pytest.raises(ValueError, match="policy: reposition=True .* float32 or wider"):
        quantized_cache(mla, kv_format, StreamingLLM(sinks=2, budget=6, reposition=True))
    with pytest.raises(ValueError, match="policy: reposition=True"):
        LatentCache.from_config(mla.config, 1, 16, dtype=torch.bfloat16, policy=StreamingLLM(budget=6, reposition=True))
    LatentCache.from_config(mla.config, 1, 16, policy=StreamingLLM(budget=6, reposition=True))  # float32: accepted
