"""Packed sequences (padding-free training) through ``apply_latent_attention``, against transformers.

transformers' convention: several sequences share one batch row, ``position_ids`` restart at 0
for each, and no ``attention_mask`` is passed (``DataCollatorWithFlattening``, TRL's
``SFTTrainer(padding_free=True)``); the flash-attention kwargs ``cu_seq_lens_q/k`` may give the
boundaries too. transformers then attends within each sequence only, and only without a cache
(its models make a ``DynamicCache`` whenever ``use_cache`` is on, so the reference is called with
``use_cache=False``, as ``Trainer`` calls it). Bounds as in ``test_model``: the two models' RoPE
tables (float32 in transformers, float64 in qkmla) bound the difference to 1e-5 of the largest
logit in float64.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import LatentAttentionCache  # noqa: E402

from .test_model import CACHE, VOCAB, hf_model, max_rel, patched  # noqa: E402

LAYOUTS = [[6, 5, 5], [3, 13]]  # two rows of 16 tokens, packed unevenly


def packed(layouts, seed: int = 1):
    """input_ids, position_ids and labels [B, T] for rows of sequences of the given lengths, and
    each sequence's ids; labels as DataCollatorWithFlattening writes them (-100 on each first token)."""
    g = torch.Generator().manual_seed(seed)
    rows = [[torch.randint(1, VOCAB, (n,), generator=g) for n in row] for row in layouts]
    ids = torch.stack([torch.cat(row) for row in rows])
    positions = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in rows])
    labels = ids.masked_fill(positions == 0, -100)
    return ids, positions, labels, rows


def cu_seq_lens(layouts) -> torch.Tensor:
    lengths = torch.tensor([n for row in layouts for n in row])
    return torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])


@pytest.mark.parametrize("variant, checkpointing, boundaries", [
    ("v3", None, "position_ids"),
    ("v3", "non-reentrant", "position_ids"),
    ("v3", "reentrant", "position_ids"),
    ("v2", None, "position_ids"),
    ("v2", "non-reentrant", "position_ids"),
    ("v3", None, "cu_seq_lens"),
    ("v3", "non-reentrant", "cu_seq_lens"),
], ids=lambda v: str(v))
def test_packed_training_matches_transformers(variant, checkpointing, boundaries):
    """Logits, loss and every gradient of two rows packed unevenly, against transformers' packed
    forward. ``cu_seq_lens``: the patched model is given the flash-attention varlen kwargs over the
    flattened batch too (transformers' SDPA ignores them and packs by position_ids)."""
    ref = hf_model(variant).train()
    model = patched(ref).train()
    if checkpointing is not None:
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    ids, positions, labels, _ = packed(LAYOUTS)
    varlen = {}
    if boundaries == "cu_seq_lens":
        cu = cu_seq_lens(LAYOUTS)
        varlen = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13, max_length_k=13)
    outs = [m(input_ids=ids, position_ids=positions, labels=labels, use_cache=False, **varlen) for m in (ref, model)]
    assert max_rel(outs[1].logits.detach(), outs[0].logits.detach()) <= 1e-5
    assert abs(outs[1].loss.item() - outs[0].loss.item()) <= 1e-6 * outs[0].loss.item()
    for out in outs:
        out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert max_rel(p.grad, q.grad) <= 1e-5, name


def test_each_packed_sequence_gets_what_it_gets_alone():
    model = patched(hf_model("v3"))
    ids, positions, _, rows = packed(LAYOUTS)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for b, row in enumerate(rows):
            start = 0
            for seq in row:
                alone = model(input_ids=seq[None], use_cache=False).logits[0]
                got = logits[b, start:start + len(seq)]
                assert max_rel(got, alone) <= 1e-7, (b, start)  # transformers' RMSNorms round to float32
                start += len(seq)


def test_a_training_step_packs_without_use_cache_false():
    """In training the patched model caches nothing whatever use_cache says, so it packs;
    transformers packs only when told use_cache=False (it makes a DynamicCache otherwise)."""
    ref = hf_model("v3").train()
    model = patched(ref).train()
    ids, positions, labels, _ = packed(LAYOUTS)
    want = ref(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
    got = model(input_ids=ids, position_ids=positions, labels=labels).loss
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()


def test_packed_scoring_without_a_cache_matches_transformers():
    ref = hf_model("v3")
    model = patched(ref)
    ids, positions, _, _ = packed(LAYOUTS)
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
        out = model(input_ids=ids, position_ids=positions)  # eval, use_cache on by default: a packed call caches nothing
    assert getattr(out, CACHE, None) is None
    assert max_rel(out.logits, want) <= 1e-5


def test_a_packed_call_with_a_cache_is_refused():
    model = patched(hf_model("v3"))
    ids, positions, _, _ = packed(LAYOUTS)
    with pytest.raises(ValueError, match="position_ids: .*packed.*cannot be cached"):
        model(input_ids=ids, position_ids=positions, **{CACHE: LatentAttentionCache(model)})
    flat, _, _, _ = packed([[6, 5]])
    with pytest.raises(ValueError, match="cu_seq_lens_q: .*packed.*cannot be cached"):
        model(input_ids=flat, cu_seq_lens_q=cu_seq_lens([[6, 5]]), **{CACHE: transformers.DynamicCache()})
    with pytest.raises(ValueError, match="cu_seq_lens_k: .*packed.*cannot be cached"):  # the argument given
        model(input_ids=flat, cu_seq_lens_k=cu_seq_lens([[6, 5]]), **{CACHE: transformers.DynamicCache()})


def test_flash_attention_varlen_kwargs_give_the_boundaries():
    """cu_seq_lens_q/k (what DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds) mark the
    sequences even where position_ids do not restart; the positions stay the ones passed."""
    layout = [[4, 7, 5]]
    model = patched(hf_model("v3"))
    ids, positions, _, rows = packed(layout)
    cu = cu_seq_lens(layout)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7, use_cache=False)
    with torch.no_grad():
        with_positions = model(input_ids=ids, position_ids=positions, **kw).logits
        without = model(input_ids=ids, **kw).logits  # positions 0..15 across the row: RoPE is relative
        assert max_rel(with_positions, model(input_ids=ids, position_ids=positions, use_cache=False).logits) <= 1e-12
        start = 0
        for seq in rows[0]:
            alone = model(input_ids=seq[None], use_cache=False).logits[0]
            assert max_rel(without[0, start:start + len(seq)], alone) <= 1e-7
            start += len(seq)


def test_plain_positions_are_not_packed_under_torch_compile(monkeypatch):
    """position_ids 0..T-1 with no mask are one sequence a row, compiled or not: transformers'
    find_packed_sequence_indices never answers "not packed" while being compiled, so the patched
    model reads the restarts itself. Compiled (backend "eager"): an evaluation call still returns a
    cache, takes one passed to it, gives eager's logits; a training call's SDPA stays causal (no
    [B, T, T] mask)."""
    from qkmla.integrations.transformers import attention

    masks = []

    def spy(*args, **kwargs):
        masks.append(kwargs.get("mask") is None)
        return sdpa(*args, **kwargs)

    sdpa = attention.sdpa
    monkeypatch.setattr(attention, "sdpa", spy)
    model = patched(hf_model("v3"))
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    kw = dict(input_ids=ids, position_ids=torch.arange(8)[None])
    with torch.no_grad():
        want = model(**kw)
        got = compiled(**kw)
        assert isinstance(getattr(want, CACHE), LatentAttentionCache)
        assert isinstance(getattr(got, CACHE, None), LatentAttentionCache)
        assert getattr(got, CACHE).get_seq_length() == 8
        assert max_rel(got.logits, want.logits) <= 1e-12
        passed = compiled(**kw, **{CACHE: LatentAttentionCache(model)})
        assert max_rel(passed.logits, want.logits) <= 1e-12
    compiled.train()
    masks.clear()
    loss = compiled(**kw, labels=ids).loss
    assert masks and all(masks), masks
    assert abs(loss.item() - model(**kw, labels=ids).loss.item()) <= 1e-12 * loss.item()


def test_with_an_attention_mask_restarting_positions_are_positions_only():
    """A mask means padding, never packing (transformers' mask functions pack only without one):
    restarting position_ids are RoPE positions and each row is one sequence, with or without
    padding in the mask, as in the stock model (SDPA); with a cache too (its RoPE keys are cached at
    these positions, as transformers' own cache holds keys rotated to them)."""
    ref = hf_model("v3")
    model = patched(ref)
    ids, positions, _, _ = packed(LAYOUTS)
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[0, :4] = 0  # padding inside row 0's first sequence
    with torch.no_grad():
        packed_logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for mask in (full, padded):
            want = ref(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            real = mask.bool()
            assert max_rel(got[real], want[real]) <= 1e-5
            assert max_rel(got[real], packed_logits[real]) > 1e-2  # not attending within each sequence
        want = ref(input_ids=ids, attention_mask=full, position_ids=positions, use_cache=True).logits
        for cache in ({CACHE: LatentAttentionCache(model)}, {}):  # passed, or made by an evaluation call
            got = model(input_ids=ids, attention_mask=full, position_ids=positions, **cache).logits
            assert max_rel(got, want) <= 1e-5


def test_with_an_attention_mask_cu_seq_lens_are_not_read():
    """cu_seq_lens_q/k beside a mask are neither read nor checked: the same logits as without them,
    and not the packed ones they give without a mask."""
    model = patched(hf_model("v3"))
    ids, _, _, _ = packed(LAYOUTS)
    cu = cu_seq_lens(LAYOUTS)
    wrong = torch.tensor([0, 6, 12], dtype=torch.int32)  # refused without a mask (test_bad_varlen_kwargs_are_refused)
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[1, :2] = 0
    with torch.no_grad():
        by_cu = model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False).logits
        for mask in (full, padded):
            plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for kw in (dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu), dict(cu_seq_lens_q=wrong), dict(cu_seq_lens_k=wrong)):
                assert torch.equal(model(input_ids=ids, attention_mask=mask, use_cache=False, **kw).logits, plain)
            real = mask.bool()
            assert max_rel(plain[real], by_cu[real]) > 1e-2


@pytest.mark.parametrize("shape, bad, match", [
    ((1, 11), dict(cu_seq_lens_q=[0, 6, 12]), r"cu_seq_lens_q: .*\[0, 6, 12\].*end at 11"),
    ((2, 5), dict(cu_seq_lens_q=[0, 8, 10]), r"cu_seq_lens_q: .*\[0, 8, 10\].*across"),
    ((1, 11), dict(cu_seq_lens_q=[0, 6, 11], cu_seq_lens_k=[0, 5, 11]), "cu_seq_lens_k: .*equal"),
    ((1, 11), dict(cu_seq_lens_k=[0, 6, 12]), r"^cu_seq_lens_k: .*\[0, 6, 12\].*end at 11"),
    ((2, 5), dict(cu_seq_lens_k=[0, 8, 10]), r"^cu_seq_lens_k: .*\[0, 8, 10\].*across"),
    ((1, 11), dict(cu_seq_lens_k=[[0, 11]]), r"^cu_seq_lens_k: expected a 1-D integer tensor"),
], ids=["wrong-total", "across-rows", "q-and-k-differ", "k-alone-wrong-total", "k-alone-across-rows",
        "k-alone-not-1-d"])
def test_bad_varlen_kwargs_are_refused(shape, bad, match):
    model = patched(hf_model("v3"))
    ids = torch.randint(1, VOCAB, shape)
    with pytest.raises(ValueError, match=match):
        model(input_ids=ids, use_cache=False, **{k: torch.tensor(v, dtype=torch.int32) for k, v in bad.items()})


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "cu-seq-lens"])
def test_trainer_with_flattening_collator_matches_transformers(tmp_path, flash_kwargs):
    """Three optimizer steps of transformers' Trainer on DataCollatorWithFlattening's batches (three
    sequences a row), the loss of every step recorded; the stock model packs by position_ids (its
    SDPA ignores cu_seq_lens), the patched one by cu_seq_lens when the collator adds them."""
    ref = hf_model("v3").train()
    model = patched(ref).train()
    g = torch.Generator().manual_seed(5)
    lengths = [7, 3, 12, 5, 9, 4, 11, 6, 8]
    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    losses = {}
    for name, m in (("stock", ref), ("qkmla", model)):
        seen = losses[name] = []
        m.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(out.loss.item()))
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=3,
                                              max_steps=3, learning_rate=1e-2, report_to=[], save_strategy="no",
                                              use_cpu=True, seed=7, data_seed=7, logging_steps=1,
                                              dataloader_num_workers=0)
        transformers.Trainer(model=m, args=args, train_dataset=data, data_collator=collator).train()
    assert len(losses["stock"]) == len(losses["qkmla"]) == 3
    # transformers computes the loss from float32 logits (a float64 model's too): equal to its rounding
    for a, b in zip(losses["qkmla"], losses["stock"]):
        assert abs(a - b) <= 1e-6 * b, (losses["qkmla"], losses["stock"])
