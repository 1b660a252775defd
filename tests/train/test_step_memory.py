"""step_memory: the bytes a training step saves for its backward, measured before the first step."""

import pytest
import torch

from qkmla.model.gpt import GPT, GPT_PRESETS
from qkmla.train.step_memory import saved_bytes, step_saved_bytes


@pytest.mark.parametrize("attn", ["mla-qknorm", "mla", "gqa-qknorm", "v4"])
def test_a_step_of_b_windows_is_measured_from_two_and_three(attn):
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn=attn, vocab_size=65))
    T = model.config.block_size
    assert step_saved_bytes(model, 5, T) == saved_bytes(model, 5, T)
    assert step_saved_bytes(model, 1, T) == saved_bytes(model, 1, T)
    assert step_saved_bytes(model, 2, T) == saved_bytes(model, 2, T)
    # At least what every layer's linears and the loss keep: the two normed inputs of each block
    # and the logits, in float32 (a bound from the config alone, the one trainer.check_sizes uses).
    c = model.config
    assert saved_bytes(model, 3, T) >= 4 * 3 * T * (c.vocab_size + 2 * c.n_layer * c.n_embd)


def test_the_measurement_leaves_the_rng_the_weights_and_the_gradients_as_they_were():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(vocab_size=65, dropout=0.2))  # dropout draws from the global RNG
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    saved_bytes(model, 2, model.config.block_size)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training


def test_the_bytes_grow_with_the_window_and_count_a_tensor_saved_twice_once():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(vocab_size=65))
    short, long = saved_bytes(model, 1, 16), saved_bytes(model, 1, 32)
    assert 2 * short - 64 <= long  # linear in the tokens at least (attention may add T^2), but for a few scalars

    class Twice(torch.nn.Module):  # one tensor saved by two ops: counted once
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x, y):
            h = x.float() + self.w  # an add saves nothing
            return None, (h * h).sum() + (h * h.detach()).sum()

    assert saved_bytes(Twice(), 4, 8) == 4 * 8 * 4  # h alone: saved three times, once a detached view
