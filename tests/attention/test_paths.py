"""Which path a forward call takes, and the calls refused before any work."""

import pytest
import torch

from qkmla import MLA, FullKVCache, LatentCache, MLAConfig
from qkmla.attention.paths import cheaper_cached_path, resolve_path


@pytest.fixture
def mla():
    return MLA(MLAConfig()).eval()


def x_of(mla, T, B=2):
    return torch.randn(B, T, mla.config.hidden_size)


def test_auto_resolves_by_cache_and_length(mla):
    empty = LatentCache.from_config(mla.config, 2, 16)
    assert resolve_path(mla, x_of(mla, 5), None, "auto", None) == "explicit"
    assert resolve_path(mla, x_of(mla, 5), FullKVCache.from_config(mla.config, 2, 16), "auto", None) == "explicit"
    assert resolve_path(mla, x_of(mla, 5), empty, "auto", None) == "explicit"  # a prefill
    assert resolve_path(mla, x_of(mla, 1), empty, "auto", None) == "absorbed"  # a first decode step
    mla(x_of(mla, 3), empty)
    assert resolve_path(mla, x_of(mla, 5), empty, "auto", None) == "absorbed"  # a chunk after the prefill
    assert resolve_path(mla, x_of(mla, 40), empty, "auto", None) == "absorbed"  # however long (bounded memory)
    assert resolve_path(mla, x_of(mla, 5), empty, "expand", None) == "expand"


# DeepSeek-V3's attention at TP=8 (16 heads) with its widths: d_c 512, d_r 64, d_n 128, d_v 128
V3 = MLAConfig(hidden_size=7168, num_heads=16, num_kv_groups=16, q_lora_rank=1536, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@pytest.mark.parametrize("new, cached, topk, path", [
    (1, 65536, None, "absorbed"),      # a decode step, however long the context
    (4, 4096, None, "absorbed"),       # speculative or multi-token decode
    (512, 4096, None, "expand"),       # a prefill chunk over a dense cache: vLLM's compute-friendly prefill
    (512, 65536, None, "expand"),
    (128, 4096, None, "absorbed"),     # below the crossover, T ~ d_c (d_n + d_v) / (d_c + d_r ...) ~ 180 here
    (512, 65536, 2048, "absorbed"),    # top-k: each query reads 2,048 latents, not 64k expanded keys
    (512, 1536, 2048, "expand"),       # a selection as long as the context is a dense one
])
def test_the_cheaper_path_for_a_call_over_a_cache(new, cached, topk, path):
    assert cheaper_cached_path(V3, new, cached, topk) == path


@pytest.mark.parametrize("sparse", [False, True])
def test_the_cheaper_path_equals_the_other_to_roundoff(sparse):
    """A chunk the cost rule sends down expand gives what absorbed gives (float64), dense and under a
    top-k selection of distinct slots within the sequence (the transformers adapter's kind)."""
    torch.manual_seed(0)
    mla = MLA(MLAConfig()).double().eval()
    x = torch.randn(2, 40, mla.config.hidden_size, dtype=torch.float64)
    outs = {}
    for path in ("expand", "absorbed"):
        cache = LatentCache.from_config(mla.config, 2, 64, dtype=torch.float64)
        mla(x[:, :8], cache)
        indices = None
        if sparse:  # each new token: the even slots before it, and itself; topk 40, the rest -1
            slots = torch.arange(40)
            chosen = [torch.cat((slots[:t][::2], slots[t:t + 1])) for t in range(8, 40)]
            indices = torch.stack([torch.cat((c, c.new_full((40 - len(c),), -1))) for c in chosen])
            indices = indices.expand(2, -1, -1).contiguous()
        assert cheaper_cached_path(mla.config, 32, 8, None if indices is None else 40) == "expand"
        assert resolve_path(mla, x[:, 8:], cache, "auto", None, indices) == "absorbed"
        outs[path] = mla(x[:, 8:], cache, path=path, indices=indices)
    torch.testing.assert_close(outs["expand"], outs["absorbed"], rtol=1e-10, atol=1e-12)
