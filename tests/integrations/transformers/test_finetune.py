"""Fine-tuning a patched, QK-normed transformers DeepSeek model: a plain PyTorch loop, transformers'
``Trainer``, PEFT LoRA on the attention projections (``qkmla.integrations.transformers.lora``).

Each test trains a few steps (the conftest's tiny DeepseekV3 shape, float32) and then checks
what training must not break: greedy decoding through the latent cache (an explicit prefill,
then absorbed steps) gives the tokens of the uncached explicit forward over the sequence it
produced, its logits within 1e-4 of the largest (the float32 bound of ``test_hf_model.py``),
and each layer's absorbed attention logits equal its explicit ones (MATH.md's Appendix E test)
to 1e-5 of the largest.

Where a model decodes before it trains, the absorbed weights that decode derived are stale
afterwards, so the check after training also shows that they were derived again: after
Trainer's fused AdamW (which bumps no version counter), and after an adapter wraps kv_b_proj
(MLA drops its kept absorbed weights at every train()/eval() switch and module swap).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.integrations.conftest import CONFIG  # noqa: E402  (importlib mode: the conftest by its package name)

from qkmla.integrations.transformers.cache import LatentCacheLayer  # noqa: E402
from qkmla.integrations.transformers import apply_latent_attention, from_pretrained  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.integrations.transformers.lora import attention_lora_config, lora_targets, merge_lora  # noqa: E402

# peft calls transformers' is_gradient_checkpointing, which transformers 5.2x deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

VOCAB = CONFIG["vocab_size"]
PROMPT, STEPS = 6, 6  # tokens prompted, tokens decoded


def tiny_model(seed: int = 0, **config) -> torch.nn.Module:
    """A random float32 DeepseekV3ForCausalLM, patched with a QK RMSNorm, in train mode; attention
    weights scaled so that its logits are a few units (attention is not flat)."""
    cfg = transformers.DeepseekV3Config(**{**CONFIG, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None,
                                           **config})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name and p.dim() == 2:
                p.mul_(3.0)
    return apply_latent_attention(model, qk_norm="rms").train()


def batch(n: int = 4, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def loss_on(model, ids: torch.Tensor) -> float:
    mode = model.training
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    model.train(mode)
    return loss


def train(model, ids: torch.Tensor, steps: int = 8, lr: float = 1e-2) -> list[float]:
    """AdamW on one batch; the losses of every step."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def decode(model, ids: torch.Tensor):
    """Greedy decode through the latent cache: generate's output (sequences, logits, cache)."""
    model.eval()
    return model.generate(input_ids=ids, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                          output_logits=True)


def check_absorbed_matches_explicit(model, prompt: torch.Tensor) -> None:
    """The latent cache's decode against the uncached explicit forward, whole model and per layer."""
    layers = latent_layers(model.get_base_model() if hasattr(model, "get_base_model") else model)
    out = decode(model, prompt)
    cache = next(v for k, v in out.items() if k in ("cache", "past_key_values"))  # the name depends on the version
    assert cache.layers and all(isinstance(layer, LatentCacheLayer) for layer in cache.layers)
    with torch.no_grad():
        full = model(input_ids=out.sequences, use_cache=False).logits  # explicit, no cache
    want = full[:, PROMPT - 1:-1]  # the logits each generated token was chosen from
    got = torch.stack(out.logits, dim=1)
    assert torch.equal(out.sequences[:, PROMPT:], want.argmax(-1))
    assert max_rel(got, want) <= 1e-4, max_rel(got, want)
    inputs = {}
    hooks = [attn.register_forward_pre_hook(lambda mod, args, kwargs, i=i: inputs.__setitem__(i, kwargs.get(
        "hidden_states", args[0] if args else None)), with_kwargs=True) for i, attn in enumerate(layers)]
    try:
        with torch.no_grad():
            model(input_ids=out.sequences, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for i, attn in enumerate(layers):
            explicit, absorbed = attn.logits(inputs[i], "explicit"), attn.logits(inputs[i], "absorbed")
            seen = explicit.isfinite()
            assert torch.equal(seen, absorbed.isfinite())
            assert max_rel(absorbed[seen], explicit[seen]) <= 1e-5, (i, max_rel(absorbed[seen], explicit[seen]))


def norm_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".q_norm." in n or ".k_norm." in n}


# -- a plain PyTorch loop ------------------------------------------------------------------------------


def test_plain_loop_trains_the_qk_norm_and_decode_stays_exact():
    model = tiny_model()
    ids = batch()
    check_absorbed_matches_explicit(model, ids[:2, :PROMPT])  # derives the absorbed weights before training
    before, norms = loss_on(model, ids), norm_weights(model)
    assert len(norms) == 3 * 4 and all(torch.equal(w, torch.ones_like(w)) for w in norms.values())
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if name in norms:
            assert p.grad is not None and p.grad.abs().max() > 0, name
    model.zero_grad()
    train(model, ids)
    assert loss_on(model, ids) < 0.9 * before
    assert all(not torch.equal(w, norms[n]) for n, w in norm_weights(model).items())
    check_absorbed_matches_explicit(model, ids[:2, :PROMPT])


# -- transformers' Trainer ---------------------------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(model, ids: torch.Tensor, out: str):
    """transformers' Trainer over ``ids`` as a data set, 16 steps of 2 sequences, its default
    optimizer (fused AdamW since torch 2.8)."""
    args = transformers.TrainingArguments(output_dir=out, max_steps=16, per_device_train_batch_size=2,
                                          learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(ids))


def test_trainer_trains_and_saves_a_checkpoint_from_pretrained_loads(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    model = tiny_model()
    ids = batch(n=8)
    before, norms = loss_on(model, ids), norm_weights(model)
    run = trainer(model, ids, str(tmp_path / "run"))
    run.train()
    assert run.state.global_step == 16
    assert loss_on(model, ids) < 0.9 * before
    assert all(not torch.equal(w, norms[n]) for n, w in norm_weights(model).items())
    check_absorbed_matches_explicit(model, ids[:2, :PROMPT])

    run.save_model(str(tmp_path / "saved"))
    loaded = from_pretrained(tmp_path / "saved")
    assert latent_layers(loaded)[0].config.qk_norm.kind == "rms"
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits)
    assert torch.equal(decode(loaded, ids[:2, :PROMPT]).sequences, decode(model, ids[:2, :PROMPT]).sequences)


def test_trainer_after_a_decode_rederives_the_absorbed_weights(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    model = tiny_model()
    ids = batch(n=8)
    decode(model, ids[:2, :PROMPT])  # derives the absorbed weights (an evaluation before or during training)
    trainer(model, ids, str(tmp_path / "run")).train()
    check_absorbed_matches_explicit(model, ids[:2, :PROMPT])


def test_fused_adamw_in_eval_mode_after_a_decode_rederives_the_absorbed_weights():
    """A model from from_pretrained is in eval mode, and DeepSeek has no dropout, so it may be
    trained there without a mode switch; fused AdamW bumps no version counter."""
    model = tiny_model().eval()
    ids = batch(n=4)
    decode(model, ids[:2, :PROMPT])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    check_absorbed_matches_explicit(model, ids[:2, :PROMPT])


# -- PEFT LoRA -----------------------------------------------------------------------------------------------


def lora_layers(model, peft) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q-lora", "no-q-lora"])
def test_lora_config_targets_exactly_the_attention_projections(q_lora_rank):
    peft = pytest.importorskip("peft")
    model = tiny_model(q_lora_rank=q_lora_rank)
    every = lora_targets(latent_layers(model)[0].config)
    q = ("q_a_proj", "q_b_proj") if q_lora_rank else ("q_proj",)
    assert every == q + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    wrapped = lora_layers(peft.get_peft_model(copy.deepcopy(model), attention_lora_config(model, targets=every)), peft)
    assert wrapped == {f"base_model.model.model.layers.{i}.self_attn.{n}" for i in range(3) for n in every}
    inner = copy.deepcopy(model).model  # the inner *Model: its module names have no "model." in front
    wrapped = lora_layers(peft.get_peft_model(inner, attention_lora_config(inner, targets="kv_b_proj")), peft)
    assert wrapped == {f"base_model.model.layers.{i}.self_attn.kv_b_proj" for i in range(3)}


def test_lora_trains_only_the_adapters_and_merges_for_absorbed_decode():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    ids = batch()
    prompt = ids[:2, :PROMPT]
    check_absorbed_matches_explicit(model, prompt)  # absorbed weights derived from the weights before LoRA
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = loss_on(model, ids)
    peft_model = peft.get_peft_model(model, attention_lora_config(model, r=4, lora_alpha=8))
    assert lora_layers(peft_model, peft) == {f"base_model.model.model.layers.{i}.self_attn.{n}" for i in range(3)
                                             for n in ("q_b_proj", "kv_b_proj", "o_proj")}
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    train(peft_model, ids, lr=2e-2)
    assert loss_on(peft_model, ids) < 0.9 * before
    after = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p
             for n, p in peft_model.named_parameters() if ".lora_" not in n}
    assert set(after) == set(base)
    for name, p in after.items():
        assert torch.equal(p, base[name]), name
    peft_model.eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids, use_cache=False).logits

    merged = merge_lora(peft_model)
    assert merged is model and not lora_layers(merged, peft)
    assert all(type(getattr(attn, n)) is torch.nn.Linear for attn in latent_layers(merged) for n in lora_targets(
        attn.config))
    with torch.no_grad():
        assert max_rel(merged(input_ids=ids, use_cache=False).logits, want) <= 1e-5
    check_absorbed_matches_explicit(merged, prompt)


def test_decoding_through_an_unmerged_adapter_on_kv_b_proj_is_refused():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    peft_model = peft.get_peft_model(model, attention_lora_config(model, targets=("kv_b_proj",)))
    peft_model.eval()
    with pytest.raises(ValueError, match=r"kv_b_proj: the absorbed path reads kv_b_proj.weight, but this kv_b_proj is "
                                         r"a peft\.tuners\.lora\.layer\.Linear.*merge_and_unload"):
        peft_model.generate(input_ids=batch()[:1, :PROMPT], max_new_tokens=2, do_sample=False)


def test_an_adapter_added_after_a_decode_is_refused_too():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    decode(model, batch()[:1, :PROMPT])  # derives the absorbed weights
    peft_model = peft.get_peft_model(model, attention_lora_config(model, targets=("kv_b_proj",),
                                                                  init_lora_weights=False))
    peft_model.eval()
    with pytest.raises(ValueError, match="kv_b_proj: the absorbed path reads kv_b_proj.weight"):
        peft_model.generate(input_ids=batch()[:1, :PROMPT], max_new_tokens=2, do_sample=False)


def test_an_adapter_on_the_query_decodes_unmerged():
    """Only kv_b_proj's weight is read by the absorbed path; an adapter elsewhere decodes as it is."""
    peft = pytest.importorskip("peft")
    model = tiny_model()
    peft_model = peft.get_peft_model(model, attention_lora_config(model, targets=("q_b_proj", "o_proj"),
                                                                  init_lora_weights=False))
    check_absorbed_matches_explicit(peft_model, batch()[:2, :PROMPT])


def test_train_qk_norm_trains_the_norms_beside_the_adapters():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    ids = batch()
    norms = norm_weights(model)
    peft_model = peft.get_peft_model(model, attention_lora_config(model, r=4, train_qk_norm=True))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad and ".lora_" not in n]
    assert len(trainable) == len(norms) and all(".modules_to_save.default." in n for n in trainable)
    train(peft_model, ids)
    merged = merge_lora(peft_model)
    assert set(norm_weights(merged)) == set(norms)
    assert all(not torch.equal(w, norms[n]) for n, w in norm_weights(merged).items())
    check_absorbed_matches_explicit(merged, ids[:2, :PROMPT])


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank, targets, match", [
    (32, ("q_norm",), r"targets: 'q_norm' is a norm, not a projection.*not LoRA targets.*train_qk_norm=True"),
    (32, ("kv_b_proj", "kv_a_layernorm"), r"targets: 'kv_a_layernorm' is a norm"),
    (32, "gate_proj", (r"targets: 'gate_proj' is not an attention projection of this model's layers; expected "
                       r"some of \('q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj'\)")),
    (32, ("q_proj",), r"targets: 'q_proj' is not .*q_lora_rank=32: the query goes through q_a_proj and q_b_proj"),
    (None, ("q_b_proj",), r"targets: 'q_b_proj' is not .*q_lora_rank=None: the query is one q_proj"),
    (32, (), r"targets: expected at least one"),
    (32, ("o_proj", 3), r"targets: expected projection names \(str\), got 3"),
    (32, 3, r"targets: expected projection names such as .*got int"),
], ids=["q_norm", "latent-norm", "mlp", "q_proj-with-q-lora", "q_b_proj-without", "empty", "not-str", "int"])
def test_a_lora_target_that_is_not_an_attention_projection_is_refused(q_lora_rank, targets, match):
    model = tiny_model(q_lora_rank=q_lora_rank)
    with pytest.raises(ValueError, match=match):
        attention_lora_config(model, targets=targets)


def test_lora_config_refuses_an_unpatched_model_and_conflicting_options():
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG))
    with pytest.raises(ValueError, match=r"^model: its attention is transformers' own; call "
                                         r"qkmla.integrations.transformers.apply_latent_attention\(model\) first"):
        attention_lora_config(model)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                                   num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"^model: expected one of .*got LlamaForCausalLM"):
        attention_lora_config(llama)
    plain = apply_latent_attention(model)  # no QK norm
    with pytest.raises(ValueError, match=r"^train_qk_norm: this model has no QK norm"):
        attention_lora_config(plain, train_qk_norm=True)
    with pytest.raises(ValueError, match=r"^target_modules: attention_lora_config sets it from targets"):
        attention_lora_config(plain, target_modules=["gate_proj"])


@pytest.mark.parametrize("arguments, match", [
    (dict(r=0), "^r: expected a positive int"), (dict(r=2.5), "^r: expected a positive int"),
    (dict(lora_alpha=float("nan")), "^lora_alpha: expected a finite number > 0"),
    (dict(lora_alpha=True), "^lora_alpha: expected a finite number > 0"),
    (dict(lora_dropout=2.0), r"^lora_dropout: expected a probability in \[0, 1\)"),
    (dict(lora_dropout=-0.1), r"^lora_dropout: expected a probability in \[0, 1\)")])
def test_lora_config_refuses_a_rank_scale_or_dropout_out_of_range(arguments, match):
    """Probe 9b (D29): attention_lora_config(model, r=0) returned a LoraConfig that failed only in
    get_peft_model; a NaN lora_alpha or a dropout of 2.0 was never refused (a NaN adapter scale, every
    activation dropped). Each is refused by name before PEFT sees it."""
    model = apply_latent_attention(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG)))
    with pytest.raises(ValueError, match=match):
        attention_lora_config(model, **arguments)
    assert attention_lora_config(model, r=2, lora_alpha=4, lora_dropout=0.5).r == 2


def test_merge_lora_needs_a_peft_model_over_a_patched_model():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    with pytest.raises(ValueError, match=r"^peft_model: expected a peft.PeftModel .*got DeepseekV3ForCausalLM"):
        merge_lora(model)
    unpatched = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG))
    stock = peft.get_peft_model(unpatched, peft.LoraConfig(r=2, target_modules=["kv_b_proj"]))
    with pytest.raises(ValueError, match=r"^peft_model: its base model is not one apply_latent_attention patched"):
        merge_lora(stock)


def test_without_peft_the_error_says_what_to_install(monkeypatch):
    model = tiny_model()
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails
    with pytest.raises(ImportError, match=r"need peft: pip install 'qkmla\[hf\]'"):
        attention_lora_config(model)
