"""Part 3: whole-model decode, tokens/s after a prefill.

qkmla's own model at the ``paper-400m`` shape (12 layers, 16 heads, d_c 256, d_r 32,
mla-qknorm, random weights, bf16), greedy, one token per sequence per step:

    latent-compiled   every layer's absorbed step (``mla_decode_step``) in one function
                      compiled with ``torch.compile(fullgraph=True)`` (inductor's default
                      mode: the step's attention op reads the lengths on the host)
    latent-eager      ``model(idx, caches)`` over the latent caches: the decode op's
                      "auto" backend (the Triton kernel on a GPU)
    fullkv-eager      the same model over full-key caches (``FullKVCache``): the cache
                      the paper avoids

A DeepSeek-V3-architecture transformers model (random weights, the attention of one
TP=8 GPU: 16 heads, d_c 512, d_r 64; a small MoE) generating with ``generate``:

    hf-unpatched      transformers as it is (its dynamic cache)
    hf-latent         after ``qkmla.integrations.transformers.apply_latent_attention(model, kv_format="dense",
                      policy=None, decode_backend="auto")``; skipped, with the reason
                      recorded, while qkmla has no such function

Decode tokens/s = batch x timed steps / seconds, the prefill excluded (for ``generate``:
the difference between N new tokens and 1). The median over rounds; the latent-compiled
step's first logits are compared with latent-eager's (``max_abs_diff_to_eager``).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from .suite import PartContext, fmt, free_memory, reset_compiler, table

REAL = dict(preset="paper-400m", batches=(1, 8), prompt=512, steps=64, warmup=3, rounds=2)
DRY = dict(preset="debug", batches=(2,), prompt=8, steps=3, warmup=1, rounds=1)
HF_REAL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=704,
               num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
               max_position_embeddings=4096)
HF_DRY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=512)
HF_GENERATE = dict(batches=(1, 8), prompt=512, new_tokens=64)
HF_GENERATE_DRY = dict(batches=(2,), prompt=8, new_tokens=3)


def model_decode_step(model, idx, absorbed, latents, scales, slots, positions, kv_format: str = "dense"):
    """Logits [B, 1, V] of one new token per sequence through every layer's absorbed step
    (``Block.forward`` with ``mla_decode_step`` for its attention; dropout is off in eval).

    idx: [B, 1]; absorbed, latents, scales: each layer's ``mla.absorbed`` and its cache's
    buffers; slots, positions: [B], where the token goes and its RoPE position."""
    from qkmla.attention.decode import mla_decode_step

    x = model.wte(idx)
    for block, weights, latent, scale in zip(model.blocks, absorbed, latents, scales):
        x = x + mla_decode_step(block.attn, block.ln_1(x), weights, latent, scale, slots, positions, kv_format)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))


class LatentCompiled:
    """Decoding through :func:`model_decode_step`, compiled once for the whole model."""

    def __init__(self, model, backend: dict):
        self.model = model
        self.step = torch.compile(model_decode_step, fullgraph=True, **backend)

    def caches(self, batch: int, capacity: int, dtype):
        return self.model.make_caches(batch, capacity, dtype=dtype)

    def __call__(self, idx, caches):
        plans = [cache.plan(idx.shape[0], 1) for cache in caches]
        absorbed = [block.attn.absorbed for block in self.model.blocks]  # read outside the graph (version counters)
        scales = [c.fields["key_scale"].data if "key_scale" in c.fields else None for c in caches]
        logits = self.step(self.model, idx, absorbed, [c.fields["latent"].data for c in caches], scales,
                           plans[0].slots[:, 0], plans[0].positions[:, 0])
        for cache, plan in zip(caches, plans):
            cache.advance(plan)
        return logits


def _eager(model):
    return lambda idx, caches: model(idx, caches=caches)[0]


def _fullkv_caches(model, batch: int, capacity: int, dtype):
    from qkmla import FullKVCache

    return [FullKVCache.from_config(b.attn.config, batch, capacity, dtype=dtype, device=model.wte.weight.device)
            for b in model.blocks]


def tokens_per_s(ctx: PartContext, step, caches, prompt: torch.Tensor, n_steps: int, warmup: int):
    """Prefill ``prompt`` [B, T] (eager), ``warmup`` untimed steps, then ``n_steps`` timed
    greedy steps; returns (decode tokens/s, the first step's logits)."""
    model_forward = step.model if isinstance(step, LatentCompiled) else None
    with torch.no_grad():
        if model_forward is not None:
            logits = model_forward(prompt, caches=caches)[0][:, -1:]
        else:
            logits = step(prompt, caches)[:, -1:]
        first = None
        for i in range(warmup + n_steps):
            if i == warmup:
                ctx.sync()
                t0 = time.perf_counter()
            logits = step(logits.argmax(-1), caches)
            if first is None:
                first = logits.float().clone()
        ctx.sync()
    return prompt.shape[0] * n_steps / (time.perf_counter() - t0), first


def qkmla_rows(ctx: PartContext) -> list[dict]:
    from qkmla.model.gpt import GPT, GPT_PRESETS
    from qkmla.ops.mla_decode import select_backend

    cfg = DRY if ctx.dry_run else REAL
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(ctx.device):  # initialized where it runs: no copy of the weights from the CPU
        model = GPT(GPT_PRESETS[cfg["preset"]].replace(attn="mla-qknorm", dropout=0.0)).to(dtype).eval()
    attn = model.blocks[0].attn.config
    backend = select_backend(attn.decode_backend, ctx.device, attn.kv_lora_rank, attn.qk_rope_head_dim)
    reset_compiler()
    compiled = LatentCompiled(model, {"backend": "aot_eager"} if ctx.dry_run else {})
    variants = {"latent-compiled": (compiled, compiled.caches), "latent-eager": (_eager(model), compiled.caches),
                "fullkv-eager": (_eager(model), lambda b, n, d: _fullkv_caches(model, b, n, d))}
    capacity = cfg["prompt"] + cfg["warmup"] + cfg["steps"]
    rows = []
    for batch in cfg["batches"]:
        prompt = torch.randint(0, model.config.vocab_size, (batch, cfg["prompt"]), device=ctx.device,
                               generator=torch.Generator(device=ctx.device).manual_seed(batch))
        samples, first = {v: [] for v in variants}, {}
        for _ in range(cfg["rounds"]):
            for name, (step, make) in variants.items():
                if ctx.out_of_time(reserve_s=30):
                    break
                if isinstance(samples[name], str):  # it failed in an earlier round: its error stands
                    continue
                try:
                    rate, first[name] = tokens_per_s(ctx, step, make(batch, capacity, dtype), prompt, cfg["steps"],
                                                     cfg["warmup"])
                    samples[name].append(rate)
                except Exception as e:
                    samples[name] = f"{type(e).__name__}: {e}"
                    ctx.log(f"{name} failed: {samples[name]}")
                free_memory()
        for name, got in samples.items():
            row = {"model": f"qkmla GPT {cfg['preset']} mla-qknorm", "variant": name, "batch": batch,
                   "prompt": cfg["prompt"], "steps": cfg["steps"], "dtype": str(dtype),
                   "decode_backend": backend if name == "latent-eager" else None}
            if isinstance(got, str):
                row["error"] = got
            elif got:
                row.update(tokens_per_s=statistics.median(got), rounds=len(got))
            else:
                row["not_run"] = "out of time"
            rows.append(row)
        if "latent-compiled" in first and "latent-eager" in first:
            diff = float((first["latent-compiled"] - first["latent-eager"]).abs().max())
            next(r for r in rows if r["variant"] == "latent-compiled" and r["batch"] == batch)[
                "max_abs_diff_to_eager"] = diff
        ctx.record["rows"] = rows
        ctx.save()
        ctx.log(f"qkmla model, batch {batch} done")
    return rows


def hf_generate_rate(ctx: PartContext, model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """Decode tokens/s of ``generate``: N new tokens minus 1, the prefill cancelled out."""
    gen = torch.Generator(device=ctx.device).manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), device=ctx.device, generator=gen)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)

    def run(n: int) -> float:
        ctx.sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        ctx.sync()
        return time.perf_counter() - t0
    run(2)  # warm-up
    # The fastest of three runs each: one run's noise on a busy machine can exceed the decode
    # time itself and make the difference negative.
    decode_s = min(run(new_tokens) for _ in range(3)) - min(run(1) for _ in range(3))
    if decode_s <= 0:
        raise RuntimeError(f"timing noise exceeded the decode time of {new_tokens - 1} tokens; raise new_tokens")
    return batch * (new_tokens - 1) / decode_s


def hf_rows(ctx: PartContext) -> list[dict]:
    try:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    except ImportError as e:
        return [{"model": "transformers DeepseekV3", "variant": "hf-unpatched", "skipped": f"transformers: {e}"}]
    import qkmla.integrations.transformers

    shape, gen_cfg = (HF_DRY, HF_GENERATE_DRY) if ctx.dry_run else (HF_REAL, HF_GENERATE)
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**shape)).to(dtype).eval()
    patched = None
    if hasattr(qkmla.integrations.transformers, "apply_latent_attention"):
        patched = copy.deepcopy(model)
        result = qkmla.integrations.transformers.apply_latent_attention(patched, kv_format="dense", policy=None,
                                                                        decode_backend="auto")
        patched = result if isinstance(result, torch.nn.Module) else patched
    variants = {"hf-unpatched": model, "hf-latent": patched}
    rows = []
    for batch in gen_cfg["batches"]:
        for name, m in variants.items():
            row = {"model": f"transformers DeepseekV3 ({shape['num_hidden_layers']} layers, "
                            f"{shape['num_attention_heads']} heads)", "variant": name, "batch": batch,
                   "prompt": gen_cfg["prompt"], "new_tokens": gen_cfg["new_tokens"], "dtype": str(dtype)}
            if m is None:
                row["skipped"] = ("qkmla.integrations.transformers.apply_latent_attention does not exist in this "
                                  "checkout; "
                                  "this row runs once it does")
            elif ctx.out_of_time(reserve_s=15):
                row["not_run"] = "out of time"
            else:
                try:
                    row["tokens_per_s"] = hf_generate_rate(ctx, m, batch, gen_cfg["prompt"], gen_cfg["new_tokens"],
                                                           shape["vocab_size"])
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            ctx.log(f"{name}, batch {batch}: {row.get('tokens_per_s', row.get('skipped', row.get('error')))}")
    return rows


def run(ctx: PartContext) -> None:
    ctx.record["rows"] = []
    try:
        qkmla_rows(ctx)
    except Exception as e:
        ctx.record["qkmla_error"] = f"{type(e).__name__}: {e}"
    free_memory()
    rows = ctx.record["rows"]
    try:
        ctx.record["rows"] = rows + hf_rows(ctx)
    except Exception as e:
        ctx.record["hf_error"] = f"{type(e).__name__}: {e}"
    failed = any("error" in r for r in ctx.record["rows"]) or "qkmla_error" in ctx.record or "hf_error" in ctx.record
    if failed or any("not_run" in r for r in ctx.record["rows"]):
        ctx.record["status"] = "partial"


def summarize(record: dict) -> list[str]:
    rows = record.get("rows", [])
    base = {(r["model"], r["batch"]): r.get("tokens_per_s") for r in rows
            if r["variant"] in ("fullkv-eager", "hf-unpatched")}
    body = []
    for r in rows:
        rate, ref = r.get("tokens_per_s"), base.get((r["model"], r["batch"]))
        note = r.get("error") or r.get("skipped") or r.get("not_run") or ""
        if r.get("decode_backend"):
            note = f"decode backend {r['decode_backend']} {note}"
        if r.get("max_abs_diff_to_eager") is not None:
            note = f"first logits within {r['max_abs_diff_to_eager']:.3g} of latent-eager {note}"
        body.append([r["model"], r["variant"], r["batch"], fmt(rate, 1),
                     fmt(rate / ref, 3) if rate and ref else "–", note.strip()])
    lines = table(["model", "variant", "batch", "decode tokens/s", "over full-KV / unpatched", "note"], body)
    for key in ("qkmla_error", "hf_error"):
        if record.get(key):
            lines.append(f"- {key}: {record[key]}")
    return lines
