"""Compiled against eager decode of the whole-model benchmark model (``bench_hf_generate``'s).

    python -m benchmarks.bench_hf_compile [--contexts 1024 4096 16384] [--steps 4] [--warmup 2]
                                          [--threads 1] [--out FILE.json] [--overwrite]

The model is ``bench_hf_generate``'s (DeepSeek-V3's attention at tensor parallelism 8, 2 layers,
random weights), float32, patched by ``apply_latent_attention``. Per context, in one fresh
process, side by side:

    eager           the default: qkmla's growing latent cache, the decode op, no compile
    eager-static    LatentAttentionCache(model, max_cache_len=N, static=True), no compile
    compiled        the same static cache, the forward compiled as transformers' generate compiles
                    it (``model.get_compiled_call(CompileConfig(...))``: inductor, dynamic=False)

Each prefills a random prompt of ``context`` tokens (eager-static and compiled share one static
cache, stepping on it in turn), then single-token decode steps are timed in rounds of one step
per variant (median after warm-up; the compiled variant's first call, which compiles, is
reported apart), so load from other jobs reaches the variants alike. The
graph breaks of one compiled decode step are counted (``torch._dynamo.explain``).

A decode step of this model reads every weight once, so its floor is set by memory traffic:
the cell measures this machine's bandwidth (a read of a buffer larger than the caches) and
its matmul peak (a float32 GEMM) on the same threads, and reports the step's bytes / bandwidth
and FLOPs / peak, and the fraction of the larger of the two each variant reaches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from .bench_hf_generate import SHAPE, build_model
from .common import add_cell_options, parse_cell_args, run_cells, start_record

VARIANTS = ("eager", "eager-static", "compiled")


def bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a float32 buffer of ``gib`` GiB), best of ``repeats``."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """float32 GEMM FLOPs per second (an n x n x n matmul), best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def step_cost(model, columns: int) -> dict:
    """What one decode step must move and compute: every parameter read once (the embedding:
    one row), the latent cache's ``columns`` rows per layer read once; FLOPs: 2 per weight of
    every matmul, plus the absorbed attention over the cache (scores and latent output)."""
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    weights = (params - embed.numel() + embed.shape[1]) * 4
    c = SHAPE
    row = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    cache = row * columns * c["num_hidden_layers"]
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 2 * c["num_attention_heads"] * columns * (2 * c["kv_lora_rank"] + c["qk_rope_head_dim"])
    absorb = 2 * 2 * c["num_attention_heads"] * c["qk_nope_head_dim"] * c["kv_lora_rank"]  # W_UK, W_UV per head
    flops = 2 * matmul + c["num_hidden_layers"] * (attention + absorb)
    return {"bytes": weights + cache, "weight_bytes": weights, "cache_bytes": cache, "flops": flops}


def run_cell(context: int, steps: int, warmup: int, threads: int) -> dict:
    from transformers import CompileConfig

    from qkmla.integrations.transformers import LatentAttentionCache

    if threads:
        torch.set_num_threads(threads)
    model = build_model(torch.float32, "qkmla")
    name = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1))
    capacity = context + 2 * (warmup + steps) + 3
    out = {"context": context, "max_cache_len": capacity, "torch_threads": torch.get_num_threads()}
    rows = {}
    with torch.inference_mode():
        # eager: the growing latent cache; the static cache serves eager-static and compiled steps in turn
        cache = LatentAttentionCache(model)
        t0 = time.perf_counter()
        logits = model(input_ids=prompt, use_cache=True, **{name: cache}).logits
        out["prefill_s_eager"] = round(time.perf_counter() - t0, 3)
        static = LatentAttentionCache(model, max_cache_len=capacity, static=True)
        t0 = time.perf_counter()
        logits_static = model(input_ids=prompt, use_cache=True, **{name: static}).logits
        out["prefill_s_static"] = round(time.perf_counter() - t0, 3)
        compiled = model.get_compiled_call(CompileConfig(fullgraph=False, dynamic=False))
        position = [context]

        def static_step(forward, t):
            ids = torch.tensor([position], dtype=torch.long)
            position[0] += 1
            return forward(input_ids=t, position_ids=ids, use_cache=True, **{name: static}).logits

        steppers = {"eager": lambda t: model(input_ids=t, use_cache=True, **{name: cache}).logits,
                    "eager-static": lambda t: static_step(model, t),
                    "compiled": lambda t: static_step(compiled, t)}
        tokens = {v: (logits if v == "eager" else logits_static)[:, -1:].argmax(-1) for v in steppers}
        t0 = time.perf_counter()
        tokens["compiled"] = steppers["compiled"](tokens["compiled"])[:, -1:].argmax(-1)
        out["compile_first_call_s"] = round(time.perf_counter() - t0, 3)
        # Interleaved, one step of each variant per round, so a change in the machine's load
        # between rounds reaches every variant alike.
        for round_ in range(warmup + steps):
            for variant, step in steppers.items():
                t0 = time.perf_counter()
                tokens[variant] = step(tokens[variant])[:, -1:].argmax(-1)
                if round_ >= warmup:
                    rows.setdefault(variant, []).append(time.perf_counter() - t0)
        ids = torch.tensor([position], dtype=torch.long)
        explained = torch._dynamo.explain(model)(input_ids=tokens["compiled"], position_ids=ids, use_cache=True,
                                                 **{name: static})
        out["compiled_step_graph_breaks"] = explained.graph_break_count
        out["compiled_step_break_reasons"] = sorted({b.reason.splitlines()[0][:160] for b in explained.break_reasons})
        out["static_columns_after"] = int(static.get_seq_length())
    cost = step_cost(model, capacity)
    bandwidth, peak = bandwidth_gbs(), peak_gflops()
    floor_s = max(cost["bytes"] / (bandwidth * 1e9), cost["flops"] / (peak * 1e9))
    out.update(step_bytes=cost["bytes"], step_weight_bytes=cost["weight_bytes"], step_cache_bytes=cost["cache_bytes"],
               step_flops=cost["flops"], measured_read_bandwidth_gbs=round(bandwidth, 2),
               measured_gemm_gflops=round(peak, 1),
               floor_ms_bytes=round(cost["bytes"] / (bandwidth * 1e9) * 1e3, 3),
               floor_ms_flops=round(cost["flops"] / (peak * 1e9) * 1e3, 3))
    variants = {}
    for variant, times in rows.items():
        step = statistics.median(times)
        variants[variant] = {"decode_step_ms": round(step * 1e3, 3), "decode_tokens_per_s": round(1 / step, 3),
                             "steps_ms": [round(t * 1e3, 2) for t in times],
                             "fraction_of_floor": round(floor_s / step, 3)}
    out["variants"] = variants
    out["compiled_over_eager"] = round(variants["eager"]["decode_step_ms"] / variants["compiled"]["decode_step_ms"], 3)
    out["compiled_over_eager_static"] = round(variants["eager-static"]["decode_step_ms"]
                                              / variants["compiled"]["decode_step_ms"], 3)
    out["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--steps", type=int, default=4, help="decode steps timed per variant (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    add_cell_options(p, threads=1, threads_help="torch threads (0: torch's default)")
    args = parse_cell_args(p, argv, run_cell)
    if args is None:
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    result, write = start_record(p, args, __spec__.name, argv)

    import transformers

    result.update(transformers=transformers.__version__, shape=SHAPE, dtype="float32", rows=[])
    cells = [dict(context=context, steps=args.steps, warmup=args.warmup, threads=args.threads)
             for context in args.contexts]
    run_cells(__spec__.name, cells, result, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
