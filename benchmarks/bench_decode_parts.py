"""Where QK-norm's decode overhead goes on this machine: the parts, timed one by one.

`bench_decode.py` times whole decode steps; this script times the pieces that QK-norm adds
or changes, at the DeepSeek-V3 TP=8 width (16 heads, G = 16, d_n 128, d_c 512, d_r 64),
float32, batch 1, so the step-level ratio can be explained:

    key-gemv              c [1, 512] x W_UK^(g)^T [512, 128], one bmm over the G groups: the
                          new token's content keys, as the library computes them
    key-gemv-split        the same product with the groups stacked, [512, 2048], through
                          qkmla.cpu.split_linear (one block of rows per thread)
    key-gemv-linear       the same product as one F.linear (MKL's GEMV, which runs on one thread)
    query-gemm            q [16, 128] x W_UK [G, 128, 512] per group (both paths do this)
    key-gemv+query-gemm   both back to back, as the decode step runs them
    scores-plain          [S, 576] x [576, 16]: plain MLA's one score GEMM
    scores-split          [S, 512] x [512, 16] over the strided rows, scaled by r in place,
                          then the [S, 64] x [64, 16] RoPE GEMM accumulated into it (beta = 1):
                          what one scalar per key and group needs, as the library computes it
    scores-split-addcmul  the same two GEMMs into two buffers, combined s_r += r * s_c (the
                          library's formulation before the in-place one)
    scores-blockdiag      [S, 576] x [576, 32] with a block-diagonal query: both scores from
                          one read of the rows, at twice the GEMM width
    latent-scores-mla     the library's score function (chunked keys), plain MLA
    latent-scores-qknorm  the same with the key scalars, blockwise
    rms-norm-cold/-warm   F.rms_norm of [1, 1, 16, 128] right after a 58 MB GEMM / warm
    proj-linear-rN        F.linear of N rows (1, 4, 32) through q_a_proj's weight [1536, 7168]
    proj-split-rN         the same through split_linear (one bmm over a block per thread),
                          as the CPU opt-in (qkmla.cpu.optimize_for_decode) runs a decode
                          step's projections
    square-sgemm          [2048, 2048] x [2048, 2048], for the machine's GEMM peak (GFLOP/s)

Every part runs "cold" (a 64 MB buffer is read before each call, as a decode step's other
weights would evict the caches) unless named warm. Parts alternate call by call; medians.

    python benchmarks/bench_decode_parts.py [--contexts 4096 16384] [--rounds 40] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from qkmla.machine import machine, recorded_command, source_commit  # noqa: E402

from qkmla.ops.mla_decode.torch_impl import latent_scores  # noqa: E402
from qkmla.cpu import split_linear  # noqa: E402

H, G, D_N, D_C, D_R = 16, 16, 128, 512, 64
PROJ_ROWS = (1, 4, 32)


def parts(context: int) -> dict:
    """The callables to time at one context length (fresh random tensors)."""
    torch.manual_seed(0)
    w_uk = torch.randn(G, D_N, D_C)
    c = torch.randn(1, 1, D_C)
    q_c = torch.randn(G, 1, D_N)
    latent = torch.randn(1, context, D_C + D_R)
    r = torch.rand(1, context, H) + 0.5
    q_lat, q_rope = torch.randn(1, H, D_C), torch.randn(1, H, D_R)
    q = torch.cat((q_lat, q_rope), dim=-1)
    q_blockdiag = torch.block_diag(q_lat[0], q_rope[0])  # [2h, d_c + d_r]
    big = torch.randn(7168, 2048)  # o_proj's size at this width: 58 MB
    x_big = torch.randn(1, 2048)
    v = torch.randn(1, 1, H, D_N)
    w_proj, x_proj = torch.randn(1536, 7168), torch.randn(max(PROJ_ROWS), 7168)  # q_a_proj's size: 44 MB
    w = torch.ones(D_N)

    def key_gemv():
        return torch.bmm(c.view(1, 1, D_C).expand(G, 1, D_C), w_uk.transpose(1, 2))

    def key_gemv_linear():
        return F.linear(c, w_uk.view(-1, D_C))

    def query_gemm():
        return torch.bmm(q_c, w_uk)

    def scores_split():
        s = torch.bmm(latent[..., :D_C], q_lat.transpose(1, 2)).mul_(r)
        return s.baddbmm_(latent[..., D_C:], q_rope.transpose(1, 2))

    def scores_split_addcmul():
        s_c = torch.bmm(latent[..., :D_C], q_lat.transpose(1, 2))
        return torch.bmm(latent[..., D_C:], q_rope.transpose(1, 2)).addcmul_(s_c, r)

    def scores_blockdiag():
        s = torch.mm(latent[0], q_blockdiag.T)
        return s[:, H:].addcmul_(s[:, :H], r[0])

    def rms_norm_cold():
        F.linear(x_big, big)
        t0 = time.perf_counter()
        F.rms_norm(v, (D_N,), w, 1e-6)
        return time.perf_counter() - t0

    return {
        "key-gemv": key_gemv,
        "key-gemv-split": lambda: split_linear(c, w_uk.view(-1, D_C)),
        "key-gemv-linear": key_gemv_linear,
        "query-gemm": query_gemm,
        "key-gemv+query-gemm": lambda: (key_gemv(), query_gemm()),
        "scores-plain": lambda: torch.bmm(latent, q.transpose(1, 2)),
        "scores-split": scores_split,
        "scores-split-addcmul": scores_split_addcmul,
        "scores-blockdiag": scores_blockdiag,
        "latent-scores-mla": lambda: latent_scores(q_lat[:, None], q_rope[:, None], latent, None),
        "latent-scores-qknorm": lambda: latent_scores(q_lat[:, None], q_rope[:, None], latent, r),
        "rms-norm-cold": rms_norm_cold,  # times itself: the GEMM before it is not counted
        "rms-norm-warm": lambda: F.rms_norm(v, (D_N,), w, 1e-6),
        **{f"proj-{how}-r{n}": functools.partial(fn, x_proj[:n], w_proj)
           for n in PROJ_ROWS for how, fn in (("linear", F.linear), ("split", split_linear))},
    }


def measure(fns: dict, rounds: int) -> dict:
    flush = torch.randn(16 * 2**20)  # 64 MB, read (not written) before every cold call
    samples = {name: [] for name in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                warm = name.endswith("-warm")
                if warm:
                    fn()
                else:
                    flush.sum()
                t0 = time.perf_counter()
                out = fn()
                elapsed = time.perf_counter() - t0
                samples[name].append(out if isinstance(out, float) else elapsed)
    return {name: statistics.median(s) for name, s in samples.items()}


def square_sgemm_gflops(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_decode_parts_cpu.json")
    args = p.parse_args(argv)
    if any(c < 1 for c in args.contexts) or args.rounds < 1:
        p.error("--contexts and --rounds must be positive")
    info = machine()
    peak = square_sgemm_gflops()
    print(f"# {info['cpu']} ({info['cores']} cores), torch {info['torch']}; square sgemm {peak:.1f} GFLOP/s")
    rows = []
    for context in args.contexts:
        seconds = measure(parts(context), args.rounds)
        one_pass = 2 * context * (D_C + D_R) * H
        flops = {name: one_pass for name in ("scores-plain", "scores-split", "scores-split-addcmul",
                                             "latent-scores-mla", "latent-scores-qknorm")}
        flops["scores-blockdiag"] = 2 * one_pass
        for name, sec in seconds.items():
            row = {"context": context, "part": name, "seconds": sec}
            if name in flops:
                row["gflops_per_s"] = flops[name] / sec / 1e9
            rows.append(row)
            rate = f"{row['gflops_per_s']:8.1f} GFLOP/s" if "gflops_per_s" in row else ""
            print(f"{context:>8} {name:<22}{sec * 1e6:10.1f} us {rate}")
        over = {name: seconds[name] / seconds["scores-plain"]
                for name in ("scores-split", "scores-split-addcmul", "scores-blockdiag")}
        print(f"{context:>8} over scores-plain: " + ", ".join(f"{k} {v:.3f}" for k, v in over.items())
              + f"; latent-scores-qknorm / -mla = {seconds['latent-scores-qknorm'] / seconds['latent-scores-mla']:.3f}")
        print(f"{context:>8} F.linear / split_linear: "
              + ", ".join(f"{n} rows {seconds[f'proj-linear-r{n}'] / seconds[f'proj-split-r{n}']:.2f}x"
                          for n in PROJ_ROWS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = recorded_command("benchmarks/bench_decode_parts.py", argv)
    args.out.write_text(json.dumps({"command": command, "commit": source_commit(HERE),
                                    "machine": info, "square_sgemm_gflops_per_s": peak,
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
