"""The fused decode kernel against plain MLA and the torch.compile path (the paper's Table 2 shape).

DeepSeek-V3 TP=8 local view: 16 heads, d_c 512, d_r 64, one scalar per head (G = 16), a
paged cache (64-token blocks, shuffled block table). For every context and batch:

    kernel-mla        the Triton kernel, scaling compiled out (plain MLA)
    kernel-qknorm     the same kernel with the key scalars
    compile-mla       torch.compile(latent_attention) over a contiguous cache (plain)
    compile-qknorm    the same with scalars (the path the paper timed)

It reports microseconds, achieved GB/s (cache bytes read / time), the percent of the memory
roofline (bytes / peak bandwidth / time) and the QK-norm overhead next to its byte bound
(G scalars against d_c + d_r values per token). Kernels need a GPU: on a CPU the script
runs the torch paths only (``--quick`` sizes) and reports GB/s against a measured copy
bandwidth.

    python benchmarks/bench_decode_kernel.py [--quick] [--out FILE.json] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qkmla.ops.mla_decode.torch_impl import latent_attention

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from qkmla.machine import machine, recorded_command, source_commit  # noqa: E402

H, D_C, D_R, G, PAGE = 16, 512, 64, 16, 64
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "H800": 3.35e12, "A100": 2.0e12}  # bytes/s, SXM parts


def peak_bandwidth(device: str) -> tuple[float, str]:
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, bw in PEAK_BANDWIDTH.items():
            if key in name:
                return bw, f"{name} datasheet"
        return 0.0, f"{name}: unknown peak"
    x = torch.empty(64 * 2 ** 20, dtype=torch.float32)  # 256 MB
    y = torch.empty_like(x)
    y.copy_(x)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    dt = (time.perf_counter() - t0) / 5
    return 2 * x.numel() * 4 / dt, "measured copy bandwidth (read + write)"


def timed(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            time.sleep(0.002)  # FlashAttention's habit: let clocks settle between runs
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inputs(batch: int, context: int, dtype, device: str):
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // PAGE)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(torch.int32)
    kv = torch.randn(batch * per_seq, PAGE, D_C + D_R, generator=gen).to(dtype)
    scales = (0.5 + torch.rand(batch * per_seq, PAGE, G, generator=gen)).to(dtype)
    q_lat = torch.randn(batch, 1, H, D_C, generator=gen).to(dtype)
    q_rope = torch.randn(batch, 1, H, D_R, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    dense = kv[table.long()].flatten(1, 2)[:, :context]  # the contiguous cache the torch path reads
    dense_scales = scales[table.long()].flatten(1, 2)[:, :context]
    to = lambda t: t.to(device)  # noqa: E731
    return [to(t) for t in (q_lat, q_rope, kv, scales, table, lens, dense, dense_scales)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small contexts (CPU-sized)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", action="store_true", help="time the eager torch path instead of torch.compile")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = args.device
    gpu = device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32  # AVX2 CPUs run bf16 matmuls far slower than fp32
    contexts = ([1024, 4096] if args.quick else [4096, 8192, 16384, 32768, 65536, 131072, 196608, 262144])
    reps = args.reps or (5 if args.quick else 30)
    fill_tokens = 2 ** 16 if args.quick else 2 ** 20  # "a batch that fills the GPU": ~1M cached tokens
    peak, peak_source = peak_bandwidth(device)
    info = machine()
    print(f"# {info.get('gpu', info['cpu'])}, torch {info['torch']}, {str(dtype)[6:]}, peak {peak / 1e9:,.0f} GB/s "
          f"({peak_source})")
    attn = latent_attention if args.no_compile else torch.compile(latent_attention, dynamic=False)
    torch_name = "eager" if args.no_compile else "compile"
    rows = []
    bytes_per = torch.tensor([], dtype=dtype).element_size()
    for context in contexts:
        for batch in sorted({1, max(1, fill_tokens // context)}):
            q_lat, q_rope, kv, scales, table, lens, dense, dense_scales = inputs(batch, context, dtype, device)
            fns = {}
            if gpu:
                from qkmla.ops.mla_decode import mla_decode_with_kvcache

                fns["kernel-mla"] = lambda: mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, None, 0.07)
                fns["kernel-qknorm"] = lambda: mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, 0.07)
            fns[f"{torch_name}-mla"] = lambda: attn(q_lat, q_rope, dense, None, 0.07)
            fns[f"{torch_name}-qknorm"] = lambda: attn(q_lat, q_rope, dense, dense_scales, 0.07)
            for name, fn in fns.items():
                seconds = timed(fn, device, reps)
                scaled = name.endswith("qknorm")
                moved = batch * context * ((D_C + D_R) * bytes_per + (G * bytes_per if scaled else 0))
                rows.append({"context": context, "batch": batch, "variant": name, "us": seconds * 1e6,
                             "bytes": moved, "gb_per_s": moved / seconds / 1e9,
                             "roofline_pct": 100 * moved / peak / seconds if peak else None})
            plain = {r["variant"]: r for r in rows if r["context"] == context and r["batch"] == batch}
            for kind in ("kernel", torch_name):
                if f"{kind}-qknorm" in plain:
                    over = plain[f"{kind}-qknorm"]["us"] / plain[f"{kind}-mla"]["us"] - 1
                    plain[f"{kind}-qknorm"]["overhead_pct"] = 100 * over
                    plain[f"{kind}-qknorm"]["byte_bound_pct"] = 100 * G / (D_C + D_R)
            for name in fns:
                r = plain[name]
                extra = f"  overhead {r['overhead_pct']:+.2f}% (bytes +{r['byte_bound_pct']:.2f}%)" if "overhead_pct" in r else ""
                roof = f"{r['roofline_pct']:6.1f}% roofline" if r["roofline_pct"] is not None else ""
                print(f"{context:>7} x{batch:<4} {name:<16}{r['us']:>12.1f} us{r['gb_per_s']:>10.1f} GB/s {roof}{extra}")
    out = args.out or HERE / "results" / f"bench_decode_kernel_{device}{'_quick' if args.quick else ''}.json"
    command = recorded_command("benchmarks/bench_decode_kernel.py", argv)
    out.write_text(json.dumps({"command": command, "commit": source_commit(HERE),
                               "machine": info, "dtype": str(dtype), "peak_bytes_per_s": peak,
                               "peak_source": peak_source, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
