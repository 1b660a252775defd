"""The whole path, on the CPU: a short QK-normed pretraining of a torchtitan DeepSeek-V3 model on the
embedded Shakespeare (torchtitan's model, optimizer container and masks; qkmla's override layer),
export to Hugging Face, then the same greedy tokens from torchtitan's own forward, from qkmla's
generation in transformers (the latent cache, the absorbed decode) and from vLLM serving the
export through qkmla's plugin. The model has vLLM's latent width (d_c + d_r = 576) and a byte
vocabulary."""

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

from qkmla import QKNormConfig  # noqa: E402
from qkmla.integrations.torchtitan.checkpoint import export_hf  # noqa: E402
from qkmla.train.data import load_bytes  # noqa: E402
from tests.integrations.torchtitan.test_checkpoint import build, tt_logits  # noqa: E402

STEPS, SEQ, BATCH = 30, 64, 4
PROMPTS = [list(b"ROMEO:"), list(b"First Citizen:\nBefore we"), list(b"O")]


def pretrain(model) -> list[float]:
    """STEPS steps of next-byte loss with torchtitan's AdamW container; returns the losses."""
    from torchtitan.components.optimizer import default_adamw

    data = torch.tensor(list(load_bytes("tiny_shakespeare")[:200_000]))
    optimizer = default_adamw(lr=3e-3).build(model_parts=[model])
    generator = torch.Generator().manual_seed(0)
    model.train()
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=generator)
        batch = torch.stack([data[s:s + SEQ + 1] for s in starts])
        logits = _forward(model, batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _forward(model, tokens):
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import get_causal_mask_mod

    B, L = tokens.shape
    mask = create_block_mask(get_causal_mask_mod(), B, None, L, L, device="cpu")
    return model(tokens, positions=torch.arange(L).expand(B, -1), attention_masks=mask)


def torchtitan_greedy(model, prompt: list[int], new: int) -> list[int]:
    seq = torch.tensor([prompt])
    for _ in range(new):
        seq = torch.cat([seq, tt_logits(model, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt):].tolist()


def test_pretrain_export_generate_and_serve_give_the_same_greedy_tokens(tmp_path, monkeypatch):
    from benchmarks.vllm_serving import reference

    model = build(QKNormConfig(), q_lora_rank=48, n_layers=2, kv_lora_rank=512, rope_dim=64, vocab=384)
    losses = pretrain(model)
    assert losses[-1] < losses[0] - 1.0, losses  # it learned something of the text
    model.eval()
    path = export_hf(model, tmp_path / "hf")
    new = 12
    want = [torchtitan_greedy(model, p, new) for p in PROMPTS]
    got = reference(path, plain=False, prompts=PROMPTS, new_tokens=new)["tokens"]
    assert got == want
    pytest.importorskip("vllm", reason="the vLLM leg: vllm is not installed here (the torchtitan CI environment "
                                       "has it)")
    import tests.integrations.vllm.test_engine as engine

    engine.byte_tokenizer(path)
    monkeypatch.setattr(engine, "PROMPTS", PROMPTS)
    monkeypatch.setattr(engine, "TOKENS", new)
    assert engine.served(path)["tokens"] == want
