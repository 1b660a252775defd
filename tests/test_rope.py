import pytest
import torch

from qkmla.rope import RotaryEmbedding


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_is_relative(interleave):
    """<RoPE_m(q), RoPE_n(k)> depends only on m - n, and rotations keep norms."""
    rope = RotaryEmbedding(16, interleave=interleave)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def dot(m, n):
        return (rope(q, torch.tensor([[m]])) * rope(k, torch.tensor([[n]]))).sum()

    torch.testing.assert_close(dot(7, 3), dot(104, 100))
    torch.testing.assert_close(rope(q, torch.tensor([[5]])).norm(), q.norm())


def test_interleaved_matches_complex_rotation():
    """DeepSeek-V2's reference: view pairs as complex numbers and multiply by e^{i t w}."""
    rope = RotaryEmbedding(8, theta=10000.0, interleave=True)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    pos = torch.arange(5).expand(2, 5)
    freqs = pos[..., None].double() * rope.inv_freq
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, 4, 2)) * torch.polar(torch.ones_like(freqs), freqs)[:, :, None])
    torch.testing.assert_close(rope(x, pos), ref.flatten(-2))


def test_odd_dim_rejected():
    with pytest.raises(ValueError, match="dim"):
        RotaryEmbedding(7)
