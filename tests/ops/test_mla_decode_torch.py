"""The torch backend's dense core: chunked scores and values, in-place softmax, folded amax."""

import pytest
import torch

from qkmla.ops.mla_decode import torch_impl


@pytest.mark.parametrize("T, h, G", [(3, 8, 4), (1, 4, 4)], ids=["grouped", "decode-head-per-group"])
@pytest.mark.parametrize("scalars, mode", [(False, "blockwise"), (True, "blockwise"), (True, "unified")])
def test_latent_attention_is_the_same_in_chunks_of_keys(monkeypatch, scalars, mode, T, h, G):
    """Scores and values go through the cache in chunks of SCORE_CHUNK keys; a chunk
    boundary (and a last, shorter chunk) must not change anything. One token with one head per group is
    the decode step's shape, where the scalars line up with the GEMM output unreshaped."""
    torch.manual_seed(0)
    B, d_c, d_r, S = 2, 16, 8, 23
    q_lat, q_rope = torch.randn(B, T, h, d_c, dtype=torch.float64), torch.randn(B, T, h, d_r, dtype=torch.float64)
    latent = torch.randn(B, S, d_c + d_r, dtype=torch.float64)
    key_scale = torch.rand(B, S, G, dtype=torch.float64) + 0.5 if scalars else None
    mask = torch.rand(B, T, S) > 0.3
    args = (q_lat, q_rope, latent, key_scale, 0.3, mask, mode)
    whole, whole_lse = torch_impl.latent_attention(*args, return_lse=True)
    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", 5)
    chunked, chunked_lse = torch_impl.latent_attention(*args, return_lse=True)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-13)
    torch.testing.assert_close(chunked_lse, whole_lse, rtol=0, atol=1e-13)
    # and the chunked scores are the definition: r * (q_lat . c) + q_rope . k_rope (blockwise)
    s = torch_impl.latent_scores(q_lat, q_rope, latent, key_scale, mode)
    s_c = torch.einsum("bthc,bsc->bths", q_lat, latent[..., :d_c])
    s_r = torch.einsum("bthr,bsr->bths", q_rope, latent[..., d_c:])
    if key_scale is None:
        want = s_c + s_r
    else:
        r = key_scale.repeat_interleave(h // G, dim=-1).permute(0, 2, 1)[:, None]  # [B, 1, h, S]
        want = r * s_c + s_r if mode == "blockwise" else r * (s_c + s_r)
    torch.testing.assert_close(s, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_latent_attention_is_softmax_then_values(masked):
    """The in-place softmax, normalized after the value GEMM, against the definition:
    softmax(scale * s) @ c per head, and log-sum-exp. A row with no visible key gives 0
    (and lse -inf), not NaN."""
    torch.manual_seed(1)
    B, T, h, G, d_c, d_r, S, scale = 2, 3, 4, 2, 16, 8, 11, 0.3
    q_lat, q_rope = torch.randn(B, T, h, d_c, dtype=torch.float64), torch.randn(B, T, h, d_r, dtype=torch.float64)
    latent = torch.randn(B, S, d_c + d_r, dtype=torch.float64)
    key_scale = torch.rand(B, S, G, dtype=torch.float64) + 0.5
    mask = None
    if masked:
        mask = torch.rand(B, T, S) > 0.3
        mask[1, 2] = False  # sequence 1, token 2 sees nothing
    out, lse = torch_impl.latent_attention(q_lat, q_rope, latent, key_scale, scale, mask, return_lse=True)
    s = scale * torch_impl.latent_scores(q_lat, q_rope, latent, key_scale)  # [B, T, h, S]
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    want_lse = torch.logsumexp(s, dim=-1)
    want = torch.einsum("bths,bsc->bthc", torch.softmax(s, dim=-1).nan_to_num(0.0), latent[..., :d_c])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-13)
    if masked:
        assert (out[1, 2] == 0).all() and torch.isneginf(lse[1, 2]).all()


@pytest.mark.parametrize("S, N", [(1, 16), (15, 16), (16, 16), (1000, 16), (37, 300), (5, 3)])
def test_amax_over_keys_folds_rows_exactly(S, N):
    s = torch.randn(2, S, N)
    s[0, S // 2] = float("-inf")
    torch.testing.assert_close(torch_impl._amax_over_keys(s), s.amax(dim=1, keepdim=True), rtol=0, atol=0)
