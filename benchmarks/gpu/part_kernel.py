"""Part 2: decode kernel timing (the paper's Table 2, FlashMLA's methodology).

DeepSeek-V3 at TP=8 (16 heads) and its full 128-head view: d_c 512, d_r 64, one key scalar
per head, a paged cache of 64-token blocks with a shuffled block table, one query token,
bf16. Contexts 4k to 256k, at batch 1 and at a batch holding about 1M cached tokens.

Rows (microseconds per call, the median of Triton's ``do_bench``: CUDA events, L2 flushed
before every call):

    kernel-mla, kernel-qknorm            the Triton kernel over bf16 rows, plain / key scalars
    kernel-mla-fp8, kernel-qknorm-fp8    the same over FlashMLA's 656-byte fp8 rows
    kernel-qknorm-vllm-row               the QK-norm kernel over vLLM's cache as the plugin
                                         (qkmla.integrations.vllm) hands it over: one bf16 row
                                         [c | k_rope | r] per token, the op given its column views
    compile-mla, compile-qknorm          torch.compile(latent_attention, mode="reduce-overhead")
                                         over a contiguous bf16 cache: the paper's baseline

Kernel calls are captured in a CUDA graph and replayed, as the reduce-overhead path replays
its own, so both timings hold the GPU's work and not Python's launch overhead.
``latent_attention`` splits the keys into chunks of ``SCORE_CHUNK`` for the CPU's caches;
here it runs one chunk per context (scores in one GEMM, values in one GEMM), which is the
plain absorbed attention and keeps each shape's compilation short.

Bytes are the cache bytes a call must read (rows, plus the bf16 key scalars for QK norm);
GB/s = bytes / time; the roofline is the datasheet HBM bandwidth (``suite.HBM_PEAK``), and
``copy_pct`` compares with a measured 1 GiB device copy. The QK-norm overhead (qknorm /
plain - 1) stands beside its byte bound (the scalars' share of the bytes: G / (d_c + d_r)), for
the scalars in their own tensor and in vLLM's rows: the second is the serving issue's target
(its extra bytes plus 2%) read at the op, on the GPU.
The kernel does not autotune: its launch configuration (BLOCK_N, BLOCK_H, splits, warps, stages:
the first of ``LAUNCH_CONFIGS`` that fits in the GPU's shared memory) is recorded per row so a
later run can compare or pin it.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .suite import PartContext, bench, copy_bandwidth, fmt, free_memory, graphed, hbm_peak, reset_compiler, table

REAL = dict(d_c=512, d_r=64, heads=(16, 128), page=64, fill_tokens=1 << 20,
            contexts=(4096, 8192, 16384, 32768, 65536, 131072, 262144))
DRY = dict(d_c=32, d_r=16, heads=(4, 8), page=16, fill_tokens=256, contexts=(64,))
# (name, kv_format, QK norm, layout): the key scalars in a tensor of their own ("apart") or at
# the end of each cache row ("row", vLLM's layout in qkmla.integrations.vllm)
KERNEL_VARIANTS = (("kernel-mla", "dense", False, "apart"), ("kernel-qknorm", "dense", True, "apart"),
                   ("kernel-mla-fp8", "fp8", False, "apart"), ("kernel-qknorm-fp8", "fp8", True, "apart"),
                   ("kernel-qknorm-vllm-row", "dense", True, "row"))
COMPILE_VARIANTS = (("compile-mla", False), ("compile-qknorm", True))
CONFIG_VARIANTS = (("kernel-mla", "dense", False), ("kernel-qknorm", "dense", True), ("kernel-qknorm-fp8", "fp8", True),
                   ("kernel-qknorm-int8", "int8", True))
COMPILE_MODE = "reduce-overhead"


def configs(shape: dict) -> list[tuple[int, int, int]]:
    """(heads, context, batch): the 16-head view first (the paper's), batch 1 and the
    batch of about ``fill_tokens`` cached tokens at every context."""
    return [(H, context, batch) for H in shape["heads"] for context in shape["contexts"]
            for batch in sorted({1, max(1, shape["fill_tokens"] // context)})]


def row_bytes(kv_format: str, shape: dict) -> int:
    from qkmla.kv_formats import row_format

    rows = row_format(kv_format, shape["d_c"], shape["d_r"])
    return rows.width * (2 if kv_format == "dense" else 1)  # dense rows are bf16 values


def read_bytes(batch: int, context: int, H: int, kv_format: str, qknorm: bool, shape: dict) -> int:
    """Cache bytes one call reads: every row once, and the bf16 key scalars with QK norm."""
    return batch * context * (row_bytes(kv_format, shape) + (2 * H if qknorm else 0))


def make_inputs(shape: dict, H: int, context: int, batch: int, device, fp8: bool = True, dense: bool = False,
                int8: bool = False):
    """bf16 queries, a paged bf16 cache with a shuffled table and its scalars; with ``fp8`` (and
    ``int8``) the same rows in FlashMLA's fp8 format (qkmla's int8 rows), with ``dense`` gathered
    into the contiguous cache the torch path reads."""
    from qkmla.kv_formats import row_format

    gen = torch.Generator(device=device).manual_seed(0)
    d_c, d_r, page = shape["d_c"], shape["d_r"], shape["page"]
    per_seq = -(-context // page)
    t = {"table": torch.randperm(batch * per_seq, generator=gen, device=device).view(batch, per_seq).to(torch.int32),
         "kv": torch.randn(batch * per_seq, page, d_c + d_r, generator=gen, device=device, dtype=torch.bfloat16),
         "scales": (0.5 + torch.rand(batch * per_seq, page, H, generator=gen, device=device)).to(torch.bfloat16),
         "q_lat": torch.randn(batch, 1, H, d_c, generator=gen, device=device, dtype=torch.bfloat16),
         "q_rope": torch.randn(batch, 1, H, d_r, generator=gen, device=device, dtype=torch.bfloat16),
         "lens": torch.full((batch,), context, dtype=torch.int32, device=device)}
    for kv_format in ("fp8",) * fp8 + ("int8",) * int8:
        rows = row_format(kv_format, d_c, d_r)
        t[f"kv_{kv_format}"] = torch.cat([rows.encode(part[..., :d_c].float(), part[..., d_c:].float())
                                          for part in t["kv"].split(1024)])  # 1024 blocks at a time: bounded copies
    if dense:
        order = t["table"].long()
        t["dense"] = t["kv"][order].flatten(1, 2)[:, :context].contiguous()
        t["dense_scales"] = t["scales"][order].flatten(1, 2)[:, :context].contiguous()
    return t


def launch_config(t: dict, kv, scales, kv_format: str, page: int, device) -> dict:
    """The split kernel's launch configuration as ``mla_decode_fwd`` last fitted it for these inputs
    (the first of its ``LAUNCH_CONFIGS`` that fits in shared memory; it does not autotune)."""
    from qkmla.ops.mla_decode.triton_kernel import fitting_config, launch_config as kernel_launch

    index = fitting_config(t["q_lat"], kv, scales, False, kv_format)
    B, S_q, H, _ = t["q_lat"].shape
    return {**kernel_launch(H, B * S_q, t["table"].shape[1] * page, torch.device(device), index), "config": index}


@contextlib.contextmanager
def one_score_chunk(context: int):
    """``latent_attention`` with every key in one chunk (see the module docstring)."""
    from qkmla.ops.mla_decode import torch_impl

    before = torch_impl.SCORE_CHUNK
    torch_impl.SCORE_CHUNK = max(before, context)
    try:
        yield torch_impl.SCORE_CHUNK
    finally:
        torch_impl.SCORE_CHUNK = before


def _row(ctx, H, context, batch, name, kv_format, qknorm, seconds, how, shape, **extra) -> dict:
    moved = read_bytes(batch, context, H, kv_format, qknorm, shape)
    peak, copy = ctx.record["peak_bytes_per_s"], ctx.record["copy_bytes_per_s"]
    return {"heads": H, "context": context, "batch": batch, "tokens": batch * context, "variant": name,
            "kv_format": kv_format, "qknorm": qknorm, "us": seconds * 1e6, "bytes": moved,
            "gb_per_s": moved / seconds / 1e9, "roofline_pct": 100 * moved / peak / seconds if peak else None,
            "copy_pct": 100 * moved / copy / seconds, "timing": how, **extra}


def kernel_rows(ctx: PartContext, shape: dict, H: int, context: int, batch: int) -> list[dict]:
    from qkmla.ops.mla_decode import mla_decode_with_kvcache

    t = make_inputs(shape, H, context, batch, ctx.device)
    scale = (3 * shape["d_r"]) ** -0.5
    rows = []
    for name, kv_format, qknorm, layout in KERNEL_VARIANTS:
        kv, scales = t["kv"] if kv_format == "dense" else t["kv_fp8"], t["scales"]
        if layout == "row":
            width = kv.shape[-1]
            # a copy with the scalars moved into the rows, for this variant only
            vllm_rows = torch.cat([kv, scales], dim=-1)
            kv, scales = vllm_rows[..., :width], vllm_rows[..., width:]

        def fn(kv=kv, scales=scales, kv_format=kv_format, qknorm=qknorm):
            return mla_decode_with_kvcache(t["q_lat"], t["q_rope"], kv, t["table"], t["lens"],
                                           scales if qknorm else None, softmax_scale=scale, backend="triton",
                                           kv_format=kv_format)
        call, how = graphed(fn, ctx)
        timing = bench(call, ctx, cpu_reps=1)
        launch = launch_config(t, kv, scales if qknorm else None, kv_format, shape["page"], ctx.device)
        rows.append(_row(ctx, H, context, batch, name, kv_format, qknorm, timing, how, shape, launch=launch,
                         layout=layout))
        del call, kv, scales
    return rows


def compile_rows(ctx: PartContext, shape: dict, H: int, context: int, batch: int) -> list[dict]:
    from qkmla.ops.mla_decode.torch_impl import latent_attention

    t = make_inputs(shape, H, context, batch, ctx.device, fp8=False, dense=True)
    scale = (3 * shape["d_r"]) ** -0.5
    reset_compiler()
    options = {"backend": "aot_eager"} if ctx.dry_run else {"mode": COMPILE_MODE}
    if ctx.device.type == "cuda":  # the cache stays where it is: no copy into the CUDA graph's inputs
        torch._dynamo.mark_static_address(t["dense"])
        torch._dynamo.mark_static_address(t["dense_scales"])
    rows = []
    with one_score_chunk(context) as chunk:
        attn = torch.compile(latent_attention, fullgraph=True, dynamic=False, **options)
        for name, qknorm in COMPILE_VARIANTS:
            def fn(qknorm=qknorm):
                return attn(t["q_lat"], t["q_rope"], t["dense"], t["dense_scales"] if qknorm else None, scale)
            t0 = time.monotonic()
            fn()
            ctx.sync()
            compile_s = time.monotonic() - t0
            rows.append(_row(ctx, H, context, batch, name, "dense", qknorm, bench(fn, ctx, cpu_reps=1),
                             f"torch.compile({options})", shape, compile_seconds=round(compile_s, 2),
                             score_chunk=chunk))
    reset_compiler()
    return rows


def config_rows(ctx: PartContext, shape: dict, H: int) -> list[dict]:
    """Every one of the kernel's ``LAUNCH_CONFIGS`` at the batch of about ``fill_tokens`` cached
    tokens of the longest context but two (65536 x 16 at full size), QK norm over bf16, fp8 and
    int8 rows (int8's 644-byte rows are not 16-byte aligned) and plain over bf16: which
    configuration is fastest, for the launcher's order. A configuration that does not fit the
    GPU's shared memory is recorded as such; out of time, the rest are listed as not run."""
    from triton.runtime.errors import OutOfResources

    from qkmla.ops.mla_decode.interface import interpreting
    from qkmla.ops.mla_decode.triton_kernel import LAUNCH_CONFIGS, launch_config, mla_decode_fwd

    context = shape["contexts"][-3] if len(shape["contexts"]) >= 3 else shape["contexts"][-1]
    batch = max(1, shape["fill_tokens"] // context)
    t = make_inputs(shape, H, context, batch, ctx.device, int8=True)
    scale = (3 * shape["d_r"]) ** -0.5
    rows, seen = [], set()
    for index in range(len(LAUNCH_CONFIGS)):
        launch = launch_config(H, batch, t["table"].shape[1] * shape["page"], ctx.device, index)
        same = tuple(launch[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages"))
        if same in seen:  # at few heads the head-block caps coincide
            continue
        seen.add(same)
        for name, kv_format, qknorm in CONFIG_VARIANTS:
            kv = t["kv"] if kv_format == "dense" else t[f"kv_{kv_format}"]
            base = {"heads": H, "context": context, "batch": batch, "variant": name, "kv_format": kv_format,
                    "qknorm": qknorm, "launch": {**launch, "config": index}}
            if ctx.out_of_time(reserve_s=15):
                rows.append({**base, "not_run": "out of time"})
                continue

            def fn(kv=kv, kv_format=kv_format, qknorm=qknorm, index=index):
                return mla_decode_fwd(t["q_lat"], t["q_rope"], kv, t["scales"] if qknorm else None, t["table"],
                                      t["lens"], scale, dot_fp32=interpreting(), kv_format=kv_format,
                                      launch_index=index)
            try:
                call, how = graphed(fn, ctx)
                row = _row(ctx, H, context, batch, name, kv_format, qknorm, bench(call, ctx, cpu_reps=1), how, shape,
                           launch={**launch, "config": index})
                del call
            except OutOfResources as e:  # Triton refuses it before it runs
                row = {**base, "does_not_fit": str(e)}
            except Exception as e:  # recorded; the other configurations still run
                row = {**base, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
    return rows


def derived(rows: list[dict]) -> list[dict]:
    """Per (heads, context, batch): QK-norm overhead beside its byte bound, fp8 over bf16
    (time and bytes), kernel over the compiled path."""
    by = {}
    for r in rows:
        by.setdefault((r["heads"], r["context"], r["batch"]), {})[r["variant"]] = r
    out = []
    for (H, context, batch), v in by.items():
        d = {"heads": H, "context": context, "batch": batch, "tokens": batch * context}

        def ratio(a, b, key="us"):
            return v[a][key] / v[b][key] if a in v and b in v else None
        for suffix in ("", "-fp8"):
            over = ratio(f"kernel-qknorm{suffix}", f"kernel-mla{suffix}")
            bound = ratio(f"kernel-qknorm{suffix}", f"kernel-mla{suffix}", "bytes")
            d[f"qknorm_overhead_pct{suffix}"] = None if over is None else 100 * (over - 1)
            d[f"byte_bound_pct{suffix}"] = None if bound is None else 100 * (bound - 1)
        over = ratio("kernel-qknorm-vllm-row", "kernel-mla")
        d["qknorm_overhead_pct_vllm_row"] = None if over is None else 100 * (over - 1)
        for kind in ("mla", "qknorm"):
            d[f"fp8_over_bf16_{kind}"] = ratio(f"kernel-{kind}-fp8", f"kernel-{kind}")
            d[f"fp8_over_bf16_bytes_{kind}"] = ratio(f"kernel-{kind}-fp8", f"kernel-{kind}", "bytes")
            d[f"kernel_over_compile_{kind}"] = ratio(f"kernel-{kind}", f"compile-{kind}")
        out.append(d)
    return out


def targets(rows: list[dict], derived_rows: list[dict], fill_tokens: int, on_gpu: bool) -> dict:
    """The issue's kernel targets, each met / missed with the configurations that miss it;
    None off a GPU or where nothing was measured."""
    def verdict(checks: list[tuple[str, bool]]):
        if not on_gpu or not checks:
            return {"met": None, "misses": []}
        return {"met": all(ok for _, ok in checks), "misses": [name for name, ok in checks if not ok]}
    key = "{heads}h {context} x{batch}".format
    roof = [(f"{key(**r)} {r['variant']}", r["roofline_pct"] is not None and r["roofline_pct"] >= 80)
            for r in rows if r["variant"] in ("kernel-mla", "kernel-qknorm") and r["tokens"] >= fill_tokens]
    overhead = [(key(**d), d["qknorm_overhead_pct"] <= d["byte_bound_pct"] + 1)
                for d in derived_rows if d["qknorm_overhead_pct"] is not None]
    faster = [(f"{key(**d)} {kind}", d[f"kernel_over_compile_{kind}"] < 1)
              for d in derived_rows for kind in ("mla", "qknorm") if d[f"kernel_over_compile_{kind}"] is not None]
    serving = [(key(**d), d["qknorm_overhead_pct_vllm_row"] <= d["byte_bound_pct"] + 2)
               for d in derived_rows if d.get("qknorm_overhead_pct_vllm_row") is not None
               and d["byte_bound_pct"] is not None]
    return {"roofline_80pct_at_1M_tokens": verdict(roof),
            "qknorm_overhead_within_byte_bound_plus_1pct": verdict(overhead),
            "kernel_faster_than_compile_at_every_context": verdict(faster),
            "vllm_row_qknorm_within_extra_bytes_plus_2pct": verdict(serving)}


def label(kind: str, H: int, context, batch) -> str:
    return f"{kind} {H}h" + (f" {context} x{batch}" if context is not None else "")


def run(ctx: PartContext) -> None:
    shape = DRY if ctx.dry_run else REAL
    peak, source = hbm_peak(ctx.device)
    ctx.record.update(shape={k: shape[k] for k in ("d_c", "d_r", "page", "fill_tokens", "heads", "contexts")},
                      peak_bytes_per_s=peak, peak_source=source, copy_bytes_per_s=copy_bandwidth(ctx),
                      compile_mode=COMPILE_MODE if not ctx.dry_run else "aot_eager (dry run)",
                      kernel_autotuned=False, rows=[], config_rows=[], not_run=[])
    ctx.log(f"peak {peak or 0:.3g} B/s ({source}), copy {ctx.record['copy_bytes_per_s']:.3g} B/s")
    plan = ([("kernel", c) for c in configs(shape)] + [("configs", (H, None, None)) for H in shape["heads"]]
            + [("compile", c) for c in configs(shape)])
    for i, (kind, (H, context, batch)) in enumerate(plan):
        if ctx.out_of_time(reserve_s=15):
            ctx.record["not_run"] = [label(k, h, c, b) for k, (h, c, b) in plan[i:]]
            ctx.record["status"] = "partial"
            break
        try:
            if kind == "configs":
                ctx.record["config_rows"] += config_rows(ctx, shape, H)
            else:
                make = kernel_rows if kind == "kernel" else compile_rows
                ctx.record["rows"] += make(ctx, shape, H, context, batch)
        except Exception as e:  # e.g. out of memory at one shape: recorded, the next shape runs
            ctx.record.setdefault("errors", []).append(f"{label(kind, H, context, batch)}: {type(e).__name__}: {e}")
            reset_compiler()
        free_memory()
        ctx.log(f"{label(kind, H, context, batch)} done")
        ctx.record["derived"] = derived(ctx.record["rows"])
        ctx.save()
    ctx.record["derived"] = derived(ctx.record["rows"])
    ctx.record["targets"] = targets(ctx.record["rows"], ctx.record["derived"], shape["fill_tokens"],
                                    ctx.device.type == "cuda")
    if ctx.record.get("errors") and ctx.record["status"] == "running":
        ctx.record["status"] = "partial"


def cell(row) -> str:
    """A configuration's time, or why there is none."""
    if row is None:
        return "–"
    if "us" in row:
        return fmt(row["us"], 1)
    return "does not fit" if "does_not_fit" in row else "not run" if "not_run" in row else "error"


def summarize(record: dict) -> list[str]:
    rows = {(r["heads"], r["context"], r["batch"], r["variant"]): r for r in record.get("rows", [])}
    peak = record.get("peak_bytes_per_s")
    lines = [f"Peak HBM {fmt(peak / 1e9 if peak else None, 0)} GB/s ({record.get('peak_source')}); "
             f"measured copy {fmt(record.get('copy_bytes_per_s', 0) / 1e9, 0)} GB/s. Compiled path: "
             f"{record.get('compile_mode')}. Times in microseconds.", ""]
    for H in record.get("shape", {}).get("heads", []):
        body = []
        for d in record.get("derived", []):
            if d["heads"] != H:
                continue
            k = (H, d["context"], d["batch"])
            us = lambda v: fmt(rows[k + (v,)]["us"], 1) if k + (v,) in rows else "–"  # noqa: E731
            qk = rows.get(k + ("kernel-qknorm",), {})
            body.append([d["context"], d["batch"], us("kernel-mla"), us("kernel-qknorm"),
                         f"{fmt(d['qknorm_overhead_pct'], 2, '%')} ({fmt(d['byte_bound_pct'], 2, '%')})",
                         fmt(d.get("qknorm_overhead_pct_vllm_row"), 2, "%"),
                         fmt(qk.get("gb_per_s"), 0), fmt(qk.get("roofline_pct"), 1, "%"),
                         fmt(d["fp8_over_bf16_qknorm"], 3), us("compile-qknorm"),
                         fmt(d["kernel_over_compile_qknorm"], 3)])
        if body:
            lines.append(f"**{H} heads**")
            lines.append("")
            lines += table(["context", "batch", "kernel plain", "kernel QK-norm", "QK-norm overhead (byte bound)",
                            "QK-norm overhead, vLLM rows",
                            "QK-norm GB/s", "QK-norm % HBM peak", "fp8 / bf16 (QK-norm)", "compile QK-norm",
                            "kernel / compile (QK-norm)"], body)
            lines.append("")
    by_config = {}
    for r in record.get("config_rows", []):
        key = (r["heads"], r["context"], r["batch"], r["launch"]["config"])
        by_config.setdefault(key, {"launch": r["launch"]})[r["variant"]] = r
    if by_config:
        lines.append("**Launch configurations** (the launcher takes the first that fits; µs)")
        lines.append("")
        body = [[H, context, batch, config,
                 "{BLOCK_H} / {BLOCK_N} / {num_warps} / {num_stages}".format(**v["launch"])]
                + [cell(v.get(name)) for name, *_ in CONFIG_VARIANTS]
                for (H, context, batch, config), v in sorted(by_config.items())]
        lines += table(["heads", "context", "batch", "config", "BLOCK_H / BLOCK_N / warps / stages", "plain",
                        "QK-norm", "QK-norm fp8", "QK-norm int8"], body)
        lines.append("")
    for name, t in (record.get("targets") or {}).items():
        met = {True: "met", False: "**missed**", None: "not evaluated (no GPU or nothing measured)"}[t["met"]]
        lines.append(f"- {name}: {met}" + (f" ({len(t['misses'])} misses: {', '.join(t['misses'][:8])}"
                                            f"{' ...' if len(t['misses']) > 8 else ''})" if t["misses"] else ""))
    if record.get("not_run"):
        lines.append(f"- not run (out of time): {len(record['not_run'])} shapes, from {record['not_run'][0]}")
    for e in record.get("errors", []):
        lines.append(f"- error: {e}")
    return lines
