"""step_memory: the bytes a training step saves for its backward, measured before the first step."""

import json

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
    assert step_saved_bytes(model, 9, T) == saved_bytes(model, 9, T)
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
    model.eval()  # measured as a step runs, in train mode, and the model's own mode put back
    assert saved_bytes(model, 2, model.config.block_size) > 0 and not model.training


def test_what_the_forward_saved_is_freed_when_the_count_returns():
    """A graph node that holds its own output is a cycle through C++ that gc cannot break: the
    hook keeps the saved tensors itself, so the count's forward leaves nothing behind (it left the
    whole forward's tensors alive, and the memory it measured taken from the run)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(vocab_size=65))
    outputs = []
    model.blocks[0].register_forward_hook(lambda m, args, out: outputs.append(weakref.ref(out)))
    saved_bytes(model, 2, model.config.block_size)
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs)


def test_a_run_trains_the_same_steps_with_the_measurement_as_without(tmp_path, monkeypatch):
    from qkmla.train.trainer import TrainConfig, train

    fast = dict(preset="debug", batch_size=4, block_size=16, eval_interval=3, eval_iters=2, progress=False,
                warmup_steps=1, steps=3)
    train(TrainConfig(**fast, out=str(tmp_path / "measured")))
    monkeypatch.setattr("qkmla.train.trainer.step_saved_bytes", lambda *a, **k: 0)
    train(TrainConfig(**fast, out=str(tmp_path / "unmeasured")))
    assert (tmp_path / "measured" / "metrics.jsonl").is_file()
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("measured", "unmeasured")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


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
