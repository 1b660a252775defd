"""DeepSeek-V3.2's sparse attention in transformers: unpatched against ``apply_latent_attention``.

    python -m benchmarks.bench_hf_sparse [--contexts 4096 16384 65536] [--dtypes float32 bfloat16]
                                         [--steps 3] [--baseline-steps N] [--prefill-max 4096]
                                         [--out FILE.json] [--overwrite] [--quick]

The model: DeepSeek-V3.2's attention at tensor parallelism 8 (V3's widths: 16 heads, q_lora_rank
1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, hidden 7168; the lightning indexer's
own: 64 heads of 128, index_topk 2048), 2 layers, a small dense MLP, random weights. Variants,
side by side in one run:

    transformers          the model as transformers runs it: the indexer picks 2,048 tokens, then
                          every cached latent is re-expanded through kv_b_proj and all keys but the
                          chosen ones are masked out
    qkmla                 apply_latent_attention(model): transformers' indexer, its choice read
                          from qkmla's latent cache by the absorbed decode op (``indices``)
    qkmla-qknorm          the same with the paper's QK norm (key scalars gathered with the rows)
    qknorm-vs-plain       not a model: the QK-normed/plain decode time, both models in one process,
                          their steps alternated (``paired_cell``); the 5% target is read here

Each (dtype, context, variant) runs in a fresh process, so its peak memory (the process's max RSS:
weights, cache and every temporary) is its own. How the cache is filled:

* up to ``--prefill-max`` tokens, by the model itself, a random prompt in chunks of ``--chunk``
  tokens for every variant (``prefill_s`` times it): the indexer's one-shot scores are
  [T, 64 heads, T] floats (4 GiB at 4k), beyond what this machine holds beside the rest;
* beyond it, by projection: each layer's cache is written directly with random rows of a trained
  model's statistics (unit-RMS latents, as after ``kv_a_layernorm``; unit-normal RoPE and indexer
  keys, as after ``k_norm``), through each variant's own cache code (qkmla's ``cache_rows`` computes
  the QK-normed variant's key scalars from them). A prefill is not run there: the indexer's scores
  alone cost 2 x 64 x 128 x T^2 flops per layer (70 TFLOP at 64k), hours on this CPU. A decode
  step's cost does not depend on what the rows hold.

Then single-token decode steps are timed (median after warm-up).
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import statistics
import sys
import time

import torch

from .common import add_cell_options, parse_cell_args, run_cell_grid

PAIRED = "qknorm-vs-plain"  # not a model: the QK-normed/plain ratio, paired in one process (paired_cell)
VARIANTS = ("transformers", "qkmla", "qkmla-qknorm", PAIRED)
SHAPE = dict(vocab_size=1024, hidden_size=7168, intermediate_size=1024, num_hidden_layers=2,
             mlp_layer_types=["dense", "dense"], num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             index_topk=2048, index_head_dim=128, index_n_heads=64, max_position_embeddings=131072,
             n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
FILL_CHUNK = 4096  # rows written per call of the projected fill


def build_model(dtype: torch.dtype, variant: str):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**SHAPE, attn_implementation="sdpa")).to(dtype).eval()
    if variant != "transformers":
        from qkmla.integrations.transformers import apply_latent_attention

        apply_latent_attention(model, qk_norm="rms" if variant == "qkmla-qknorm" else None)
    return model


def fill_by_projection(model, cache, variant: str, tokens: int, dtype: torch.dtype) -> None:
    """Write ``tokens`` random rows into every layer of ``cache`` (module docstring), in chunks."""
    g = torch.Generator().manual_seed(2)
    c = SHAPE
    for layer_idx in range(c["num_hidden_layers"]):
        for start in range(0, tokens, FILL_CHUNK):
            n = min(FILL_CHUNK, tokens - start)
            latent = torch.randn(1, n, c["kv_lora_rank"], generator=g).to(dtype)
            k_rope = torch.randn(1, n, c["qk_rope_head_dim"], generator=g).to(dtype)
            index_keys = torch.randn(1, n, c["index_head_dim"], generator=g).to(dtype)
            if variant == "transformers":  # what DeepseekV32Attention writes: [B, 1, T, d] latents, then the indexer's keys
                cache.update(latent[:, None], k_rope[:, None], layer_idx)
                cache.update_indexer(index_keys, layer_idx)
                continue
            from qkmla.integrations.transformers.patched import latent_layers
            from qkmla.integrations.transformers.sparse_cache import sparse_cache_layer

            attn = latent_layers(model)[layer_idx]
            layer = sparse_cache_layer(cache, layer_idx, attn.config)
            rows = layer.reserve(1, n, latent.device, dtype)
            slot = rows.plan(1, n)
            rows.append(slot, **attn.cache_rows(None, slot.positions, latent=(latent, k_rope[:, :, None]), cache=rows))
            layer.update_indexer(index_keys)
            layer.advance(None, 1, n)


def cache_bytes(cache, tokens: int) -> dict:
    """Bytes per cached token, summed over layers: the attention's cache and the indexer's keys."""
    indexer = sum(layer.indexer_keys.numel() * layer.indexer_keys.element_size() for layer in cache.layers) / tokens
    if hasattr(cache, "bytes_per_token"):  # qkmla's: latent, RoPE key and key scalars per row
        attention = cache.bytes_per_token
    else:
        attention = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        attention /= tokens
    return {"cache_bytes_per_token": round(attention + indexer, 1), "attention_cache_bytes_per_token": round(attention, 1),
            "indexer_key_bytes_per_token": round(indexer, 1)}


def prepare(dtype: torch.dtype, context: int, variant: str, chunk: int, prefill_max: int) -> dict:
    """``variant``'s model and cache filled to ``context`` tokens (module docstring): a dict of the
    model, its cache, the cache argument's name, the next token and how the cache was filled."""
    from qkmla.integrations.transformers import LatentAttentionCache

    model = build_model(dtype, variant)
    if variant == "transformers":
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
    else:
        cache = LatentAttentionCache(model)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    run = dict(model=model, cache=cache, name=name)
    with torch.inference_mode():  # the model is built outside it: its weights are not inference tensors
        fill(run, dtype, context, variant, chunk, prefill_max)
    return run


def fill(run: dict, dtype: torch.dtype, context: int, variant: str, chunk: int, prefill_max: int) -> None:
    """:func:`prepare`'s fill of ``run``'s cache, by prefill or by projection."""
    model, cache, name = run["model"], run["cache"], run["name"]
    if context <= prefill_max:
        prompt = torch.randint(0, SHAPE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        for piece in prompt.split(chunk, dim=1):
            logits = model(input_ids=piece, use_cache=True, **{name: cache}).logits
        run.update(prefill_s=round(time.perf_counter() - t0, 3), fill=f"prefill, chunks of {chunk}",
                   token=logits[:, -1:].argmax(-1))
    else:
        fill_by_projection(model, cache, variant, context, dtype)
        run.update(prefill_s=None, fill="by projection (no prefill: module docstring)",
                   token=torch.ones(1, 1, dtype=torch.long))


def decode_step(run: dict) -> float:
    """One timed decode step of ``run`` (:func:`prepare`), its next token kept; seconds."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = run["model"](input_ids=run["token"], use_cache=True, **{run["name"]: run["cache"]}).logits
        elapsed = time.perf_counter() - t0
    run["token"] = logits[:, -1:].argmax(-1)
    return elapsed


def run_cell(dtype_name: str, context: int, variant: str, steps: int, warmup: int, chunk: int, prefill_max: int,
             threads: int) -> dict:
    if threads:
        torch.set_num_threads(threads)
    if variant == PAIRED:
        return paired_cell(dtype_name, context, steps, warmup, chunk, prefill_max)
    run = prepare(getattr(torch, dtype_name), context, variant, chunk, prefill_max)
    times = [decode_step(run) for _ in range(warmup + steps)]
    step = statistics.median(times[warmup:])
    return {"dtype": dtype_name, "context": context, "variant": variant, "fill": run["fill"],
            "prefill_s": run["prefill_s"], "decode_step_ms": round(step * 1e3, 3),
            "decode_tokens_per_s": round(1 / step, 3), "decode_steps_timed": steps,
            **cache_bytes(run["cache"], context + warmup + steps), "torch_threads": torch.get_num_threads(),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "load_average_1min_at_end": round(os.getloadavg()[0], 2)}  # other work on the machine


def paired_cell(dtype_name: str, context: int, steps: int, warmup: int, chunk: int, prefill_max: int) -> dict:
    """The QK-normed/plain decode time measured paired in one process: both models (the same
    weights) filled alike, their steps alternated, plain first on even steps and QK-normed first
    on odd ones, so that drift and order touch both alike; the ratio of each pair, then the
    median. Half the pairs are timed with plain built first, half (both rebuilt) with QK-normed
    built first: which model's memory was placed first changed the ratio by several percent on
    this machine. Separate processes (the ``qkmla`` and ``qkmla-qknorm`` rows) differ by more than
    5% from one run to the next here, the placement of each process's memory, not the norm."""
    dtype = getattr(torch, dtype_name)
    ratios, plain_s, normed_s, halves = [], [], [], []
    for order in (("qkmla", "qkmla-qknorm"), ("qkmla-qknorm", "qkmla")):  # plain built first, then QK-normed
        runs = {v: prepare(dtype, context, v, chunk, prefill_max) for v in order}
        half = []
        for i in range(warmup + -(-steps // 2)):
            seq = ("qkmla", "qkmla-qknorm") if i % 2 == 0 else ("qkmla-qknorm", "qkmla")
            t = {v: decode_step(runs[v]) for v in seq}
            if i >= warmup:
                half.append(t["qkmla-qknorm"] / t["qkmla"])
                plain_s.append(t["qkmla"])
                normed_s.append(t["qkmla-qknorm"])
        fill = runs["qkmla"]["fill"]
        del runs
        ratios += half
        halves.append(round(statistics.median(half), 4))
    return {"dtype": dtype_name, "context": context, "variant": PAIRED, "fill": fill,
            "decode_time_vs_plain": round(statistics.median(ratios), 4),
            "median_95ci": [round(x, 4) for x in median_interval(ratios, strata=2)],
            "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
            "median_plain_built_first": halves[0], "median_qknorm_built_first": halves[1],
            "ratios": [round(r, 4) for r in ratios], "plain_step_ms": round(statistics.median(plain_s) * 1e3, 3),
            "qknorm_step_ms": round(statistics.median(normed_s) * 1e3, 3), "pairs_timed": len(ratios),
            "torch_threads": torch.get_num_threads(), "load_average_1min_at_end": round(os.getloadavg()[0], 2)}


def median_interval(values: list, strata: int = 1, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of ``values`` (the median of an even
    count: the mean of its two middle values, as ``statistics.median``), resampled within each of
    ``strata`` equal consecutive parts (the paired cell's two build orders), with a fixed seed, so
    a results file can be recomputed from its own pairs."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.tensor(values, dtype=torch.float64).view(strata, -1)
    n = parts.shape[1]
    picks = torch.randint(0, n, (resamples, strata, n), generator=g)
    drawn = torch.gather(parts.expand(resamples, -1, -1), 2, picks).view(resamples, -1)
    medians = drawn.quantile(0.5, dim=1).sort().values
    return float(medians[int(0.025 * resamples)]), float(medians[int(0.975 * resamples) - 1])


def summarize(rows: list) -> list:
    """Per (dtype, context): each qkmla variant's decode speed-up over transformers, its cache bytes
    against transformers', and the QK-normed variant's decode time against plain qkmla's: from
    the two rows (``decode_time_vs_plain``, separate processes) and, where it ran, paired in one
    process (``decode_time_vs_plain_paired``, :func:`paired_cell`: the target's measurement)."""
    def find(row, variant):
        return next((r for r in rows if r["variant"] == variant and r["dtype"] == row["dtype"]
                     and r["context"] == row["context"] and "error" not in r), None)

    out = []
    for row in rows:
        if row["variant"] in ("transformers", PAIRED) or "error" in row:
            continue
        entry = {"dtype": row["dtype"], "context": row["context"], "variant": row["variant"]}
        base = find(row, "transformers")
        if base is not None:
            entry["decode_speedup"] = round(base["decode_step_ms"] / row["decode_step_ms"], 2)
            entry["cache_bytes_ratio"] = round(row["cache_bytes_per_token"] / base["cache_bytes_per_token"], 4)
        plain = find(row, "qkmla")
        if row["variant"] == "qkmla-qknorm" and plain is not None:
            entry["decode_time_vs_plain"] = round(row["decode_step_ms"] / plain["decode_step_ms"], 3)
        paired = find(row, PAIRED)
        if row["variant"] == "qkmla-qknorm" and paired is not None:
            entry["decode_time_vs_plain_paired"] = paired["decode_time_vs_plain"]
        out.append(entry)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=3, help="decode steps timed per cell (after --warmup)")
    p.add_argument("--baseline-steps", type=int, default=None,
                   help="decode steps timed for the transformers variant (default: --steps): its steps are the "
                        "long ones, and the QK-normed/plain comparison wants more of qkmla's")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk, every variant")
    p.add_argument("--prefill-max", type=int, default=4096,
                   help="longest context filled by a prefill; longer ones are filled by projection")
    add_cell_options(p, threads=1, threads_help="torch threads per cell (0: torch's default); 1 holds up on a shared "
                                                "machine", quick="4k context, float32, 1 step")
    args = parse_cell_args(p, argv, run_cell, positive_ints=("steps", "chunk"))
    if args is None:
        return 0
    if args.baseline_steps is not None and args.baseline_steps < 1:
        p.error(f"--baseline-steps: expected a positive int, got {args.baseline_steps}")
    if args.prefill_max < 0:
        p.error(f"--prefill-max: expected an int >= 0, got {args.prefill_max}")
    if args.quick:
        args.contexts, args.dtypes, args.steps, args.warmup = [4096], ["float32"], 1, 1
    baseline = {"transformers": args.baseline_steps} if args.baseline_steps is not None else None
    run_cell_grid(p, args, argv, __spec__.name, SHAPE, summarize, variant_steps=baseline, chunk=args.chunk,
                  prefill_max=args.prefill_max)
    return 0


if __name__ == "__main__":
    sys.exit(main())
