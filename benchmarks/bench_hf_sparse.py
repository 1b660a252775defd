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

VARIANTS = ("transformers", "qkmla", "qkmla-qknorm")
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


def run_cell(dtype_name: str, context: int, variant: str, steps: int, warmup: int, chunk: int, prefill_max: int,
             threads: int) -> dict:
    from qkmla.integrations.transformers import LatentAttentionCache

    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    model = build_model(dtype, variant)
    if variant == "transformers":
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
    else:
        cache = LatentAttentionCache(model)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        if context <= prefill_max:
            prompt = torch.randint(0, SHAPE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1))
            t0 = time.perf_counter()
            for piece in prompt.split(chunk, dim=1):
                logits = model(input_ids=piece, use_cache=True, **{name: cache}).logits
            prefill_s, fill = round(time.perf_counter() - t0, 3), f"prefill, chunks of {chunk}"
            token = logits[:, -1:].argmax(-1)
        else:
            fill_by_projection(model, cache, variant, context, dtype)
            prefill_s, fill = None, "by projection (no prefill: module docstring)"
            token = torch.ones(1, 1, dtype=torch.long)
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            logits = model(input_ids=token, use_cache=True, **{name: cache}).logits
            times.append(time.perf_counter() - t0)
            token = logits[:, -1:].argmax(-1)
    step = statistics.median(times[warmup:])
    return {"dtype": dtype_name, "context": context, "variant": variant, "fill": fill, "prefill_s": prefill_s,
            "decode_step_ms": round(step * 1e3, 3), "decode_tokens_per_s": round(1 / step, 3),
            "decode_steps_timed": steps, **cache_bytes(cache, context + warmup + steps),
            "torch_threads": torch.get_num_threads(),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "load_average_1min_at_end": round(os.getloadavg()[0], 2)}  # other work on the machine


def summarize(rows: list) -> list:
    """Per (dtype, context): each qkmla variant's decode speed-up over transformers, its cache bytes
    against transformers', and the QK-normed variant's decode time against plain qkmla's."""
    def find(row, variant):
        return next((r for r in rows if r["variant"] == variant and r["dtype"] == row["dtype"]
                     and r["context"] == row["context"] and "error" not in r), None)

    out = []
    for row in rows:
        if row["variant"] == "transformers" or "error" in row:
            continue
        entry = {"dtype": row["dtype"], "context": row["context"], "variant": row["variant"]}
        base = find(row, "transformers")
        if base is not None:
            entry["decode_speedup"] = round(base["decode_step_ms"] / row["decode_step_ms"], 2)
            entry["cache_bytes_ratio"] = round(row["cache_bytes_per_token"] / base["cache_bytes_per_token"], 4)
        plain = find(row, "qkmla")
        if row["variant"] == "qkmla-qknorm" and plain is not None:
            entry["decode_time_vs_plain"] = round(row["decode_step_ms"] / plain["decode_step_ms"], 3)
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
