"""Part 1: correctness on the device, before any timing.

* **tests**: the test suite's CUDA tests (those marked ``cuda``: they pick a CUDA device when
  one is there) in one pytest process of their own, serially on the one GPU; counts and failures
  from its JUnit XML.
* **kernel**: the decode op's Triton kernel against the spec (``naive``, float32) at real
  sizes: d_c 512, d_r 64; 16 and 128 heads (one key scalar per head); bf16 queries; a paged
  cache with block sizes 16 and 64, a shuffled block table, NaN (0xFF bytes) in every slot
  no sequence owns; lengths 1 to 64k and 0 in one batch; 1 and 2 query tokens; dense bf16,
  fp8 and int8 rows; plain MLA, blockwise and unified QK norm; and the dense cases with the
  key scalars inside each cache row, read through column views (vLLM's layout, as
  qkmla.integrations.vllm hands it to the kernel on CUDA). A case passes when the
  kernel's largest error against the float32 spec is at most twice that of the spec run in
  bf16 plus one bf16 ulp of the largest output (the bar tests/ops/test_mla_decode.py sets),
  the same for the log-sum-exp, no output is NaN and lse is -inf exactly where no slot is
  visible.
* **compiled step**: ``decode_one_token`` with ``torch.compile(mla_decode_step,
  fullgraph=True)`` against the eager layer (``MLA.forward``, decode backend "triton") on a
  DeepSeek-V3 TP=8 layer in bf16, batch 1 and a batch of 4 uneven lengths, both against the
  same layer in float32 (torch backend): the compiled step's error is at most twice the
  eager step's plus two bf16 ulps of the largest output.

The dry run: tiny widths (d_c 32, d_r 16; 4 and 8 heads), the kernel in Triton's
interpreter, the covering subset of the kernel grid, one test, the compiled step through
``aot_eager``, float32.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import torch

from .suite import REPO, PartContext, covering, covering_first, free_memory, reset_compiler, sci, table

REAL = dict(d_c=512, d_r=64, heads=(16, 128), pages=(16, 64), lengths=(1, 1000, 4097, 65536, 0))
DRY = dict(d_c=32, d_r=16, heads=(4, 8), pages=(16, 64), lengths=(1, 37, 100, 0))
FORMATS = ("dense", "fp8", "int8")
NORMS = {"plain": (False, "blockwise"), "blockwise": (True, "blockwise"), "unified": (True, "unified")}
CUDA_MARKER = "cuda"  # pyproject.toml's marker: a test that moves to a GPU when there is one
DRY_RUN_TESTS = "test_bad_inputs"
TEST_SHARE, KERNEL_SHARE = 0.35, 0.45  # of the part's budget; the compiled step gets the rest


def cuda_test_files() -> list[str]:
    """The test files with tests marked ``CUDA_MARKER``: pytest collects only these (collecting
    the whole suite imports every integration)."""
    mark = f"pytest.mark.{CUDA_MARKER}"
    files = sorted(p for p in (REPO / "tests").rglob("test_*.py") if mark in p.read_text())
    return [str(p.relative_to(REPO)) for p in files]


def _junit(path) -> dict:
    """Counts and failing cases of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failures = []
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                failures.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": child.tag,
                                 "message": (child.get("message") or "")[:500]})
    return {"counts": counts, "failures": failures}


def run_tests(ctx: PartContext, timeout_s: float) -> dict:
    files = cuda_test_files()
    result = {"files": files}
    if importlib.util.find_spec("pytest") is None:
        return {**result, "status": "skipped",
                "reason": "pytest is not installed here: bring its wheels and pass --wheels DIR (docs/benchmarks.md)"}
    junit = ctx.out / f"{ctx.stem}_pytest.xml"
    # addopts without its "-n auto": one process on the one GPU, rather than a worker per core each
    # starting a CUDA context (and, in the dry run, no workers to bring up for one test)
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=--import-mode=importlib", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-m", CUDA_MARKER, *files]
    if ctx.dry_run:
        cmd += ["-k", DRY_RUN_TESTS]
    result["command"] = " ".join(cmd[1:])
    ctx.log(f"pytest on {len(files)} files, {timeout_s:.0f} s at most")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, timeout=max(10.0, timeout_s), capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:]
        return {**result, "status": "timeout", "seconds": round(time.monotonic() - t0, 1),
                "output_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    result.update(returncode=proc.returncode, seconds=round(time.monotonic() - t0, 1),
                  output_tail=(proc.stdout + proc.stderr)[-3000:])
    if junit.is_file():
        result.update(_junit(junit))
    ran = result.get("counts", {}).get("tests", 0)
    # pytest exits 0 when every selected test passed (or skipped), 5 when it selected none.
    result["status"] = "ok" if proc.returncode == 0 and ran > 0 else "failed"
    return result


# -- the kernel against the spec ------------------------------------------------------------

def kernel_inputs(shape: dict, H: int, page: int, S_q: int, kv_format: str, scaled: bool, device, seed: int = 0,
                  layout: str = "apart"):
    """Keyword arguments of ``mla_decode_with_kvcache`` for one case: bf16 queries, a paged
    cache (shuffled table; NaN, or 0xFF bytes, in every slot no sequence owns), G = H; with
    ``layout="row"`` (dense rows only) the scalars end each cache row [c | k_rope | r], the
    cache and the scalars column views of it."""
    from qkmla.kv_formats import row_format

    gen = torch.Generator(device=device).manual_seed(seed)
    d_c, d_r, lengths = shape["d_c"], shape["d_r"], shape["lengths"]
    B = len(lengths)
    rows = row_format(kv_format, d_c, d_r)
    per_seq = -(-max(lengths) // page) + 1
    n_blocks = B * per_seq + 3  # a few blocks nobody owns
    table_ = torch.randperm(n_blocks, generator=gen, device=device)[:B * per_seq].view(B, per_seq).to(torch.int32)
    if layout not in ("apart", "row") or (layout == "row" and kv_format != "dense"):
        raise ValueError(f"layout: expected 'apart', or 'row' with dense rows, got {layout!r} with {kv_format!r}")
    if layout == "row":
        both = torch.full((n_blocks, page, rows.width + H), float("nan"), dtype=torch.bfloat16, device=device)
        kv, scales = both[..., :rows.width], both[..., rows.width:]
    elif kv_format == "dense":
        kv = torch.full((n_blocks, page, rows.width), float("nan"), dtype=torch.bfloat16, device=device)
    else:
        kv = torch.full((n_blocks, page, rows.width), 0xFF, dtype=torch.uint8, device=device)
    if layout == "apart":
        scales = torch.full((n_blocks, page, H), float("nan"), dtype=torch.bfloat16, device=device)
    for b, n in enumerate(lengths):
        slot = torch.arange(n, device=device)
        where = (table_[b, slot // page].long(), slot % page)
        values = torch.randn(n, d_c + d_r, generator=gen, device=device)
        kv[where] = rows.encode(values[:, :d_c], values[:, d_c:]).to(kv.dtype)
        scales[where] = (0.5 + torch.rand(n, H, generator=gen, device=device)).to(torch.bfloat16)
    q_lat = torch.randn(B, S_q, H, d_c, generator=gen, device=device).to(torch.bfloat16)
    q_rope = torch.randn(B, S_q, H, d_r, generator=gen, device=device).to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return dict(q_lat=q_lat, q_rope=q_rope, kv_cache=kv, block_table=table_, cache_seqlens=lens,
                scale_cache=scales if scaled else None, softmax_scale=(3 * d_r) ** -0.5, kv_format=kv_format)


def check_kernel_case(args: dict, mode: str) -> dict:
    """The kernel's errors against the float32 spec, beside the spec's own in bf16."""
    from qkmla.ops.mla_decode import mla_decode_with_kvcache, naive_mla_decode

    spec = dict(q_lat=args["q_lat"], q_rope=args["q_rope"], kv_cache=args["kv_cache"],
                block_table=args["block_table"], cache_seqlens=args["cache_seqlens"],
                scale_cache=args["scale_cache"], softmax_scale=args["softmax_scale"], mode=mode,
                kv_format=args["kv_format"])
    ref, ref_lse = naive_mla_decode(**spec)
    base, base_lse = naive_mla_decode(**spec, compute_dtype=torch.bfloat16)
    out, lse = mla_decode_with_kvcache(**args, mode=mode, backend="triton")
    seen = torch.isfinite(ref_lse)
    kernel_err = float((out.float() - ref).abs().max())
    base_err = float((base.float() - ref).abs().max())
    ulp = torch.finfo(torch.bfloat16).eps * float(ref.abs().max())
    lse_err = float((lse[seen] - ref_lse[seen]).abs().max()) if seen.any() else 0.0
    lse_base_err = float((base_lse[seen] - ref_lse[seen]).abs().max()) if seen.any() else 0.0
    lse_ulp = torch.finfo(torch.bfloat16).eps * (float(ref_lse[seen].abs().max()) if seen.any() else 0.0)
    empty = args["cache_seqlens"] == 0
    row = {"kernel_err": kernel_err, "bf16_spec_err": base_err, "err_budget": 2 * base_err + ulp,
           "lse_err": lse_err, "lse_budget": 2 * lse_base_err + lse_ulp,
           "nan_free": not bool(torch.isnan(out).any()),
           "lse_inf_where_nothing_visible": bool(torch.equal(torch.isfinite(lse), seen)),
           "empty_sequence_zero": bool(out[empty].abs().max() == 0) if empty.any() else True}
    row["passed"] = (row["nan_free"] and row["lse_inf_where_nothing_visible"] and row["empty_sequence_zero"]
                     and kernel_err <= row["err_budget"] and lse_err <= row["lse_budget"])
    return row


def run_kernel_checks(ctx: PartContext, deadline_s: float) -> dict:
    shape = DRY if ctx.dry_run else REAL
    # the head count varies fastest after the covering cases, so that a run cut short at its
    # deadline has checked both head counts at the formats and norms it reached
    axes = dict(kv_format=list(FORMATS), norm=list(NORMS), page=list(shape["pages"]), s_q=[1, 2],
                heads=list(shape["heads"]))
    grid = [{**case, "layout": "apart"} for case in (covering(axes) if ctx.dry_run else covering_first(axes))]
    covered = max(len(v) for v in axes.values())
    # vLLM's rows (dense, QK norm): every head count, both block sizes, both score modes; right
    # after the covering cases, since the serving plugin reads its cache this way
    rows = [dict(heads=H, page=shape["pages"][(i + k) % 2], s_q=1, kv_format="dense", norm=norm, layout="row")
            for k, norm in enumerate(("blockwise", "unified")) for i, H in enumerate(shape["heads"])]
    cases = grid[:covered] + rows + grid[covered:]
    result = {"shape": {k: shape[k] for k in ("d_c", "d_r", "lengths")}, "cases": len(cases), "rows": []}
    ctx.record["kernel"] = result
    for case in cases:
        if ctx.time_left() < deadline_s:
            break
        scaled, mode = NORMS[case["norm"]]
        t0, args = time.monotonic(), None
        try:
            args = kernel_inputs(shape, case["heads"], case["page"], case["s_q"], case["kv_format"], scaled,
                                 ctx.device, layout=case["layout"])
            row = {**case, **check_kernel_case(args, mode)}
        except Exception as e:  # one case's failure is recorded; the others still run
            row = {**case, "passed": False, "error": f"{type(e).__name__}: {e}"}
        row["seconds"] = round(time.monotonic() - t0, 2)
        result["rows"].append(row)
        ctx.log(f"kernel {case}: {'ok' if row['passed'] else 'FAILED'}")
        ctx.save()
        del args
        free_memory()
    result["passed"] = sum(r["passed"] for r in result["rows"])
    result["failed"] = len(result["rows"]) - result["passed"]
    result["not_run"] = len(cases) - len(result["rows"])
    return result


# -- the compiled decode step ---------------------------------------------------------------

def step_layer(ctx: PartContext):
    """(the bf16 layer whose decode backend is the kernel, its float32 twin on the torch
    backend, the dtype); the dry run: a tiny float32 layer."""
    from qkmla import MLA, mla_preset

    if ctx.dry_run:
        cfg = mla_preset("tiny", qk_rope_head_dim=16, decode_backend="triton")
        dtype = torch.float32
    else:
        cfg = mla_preset("deepseek-v3-tp8", decode_backend="triton")
        dtype = torch.bfloat16
    torch.manual_seed(0)
    layer = MLA(cfg).to(ctx.device, dtype).eval()
    reference = copy.deepcopy(layer).float()  # the same (rounded) weights, float32 arithmetic
    reference.config = reference.config.replace(decode_backend="torch")
    return layer, reference, dtype


def check_compiled_step(ctx: PartContext, batches: dict, new_tokens: int = 4) -> list[dict]:
    from qkmla import LatentCache
    from qkmla.attention.decode import decode_one_token, mla_decode_step

    layer, reference, dtype = step_layer(ctx)
    backend = {"backend": "aot_eager"} if ctx.dry_run else {}
    rows = []
    for name, lengths in batches.items():
        if ctx.out_of_time(10):
            break
        reset_compiler()  # each batch size gets its own static-shape compilation
        step = torch.compile(mla_decode_step, fullgraph=True, **backend)
        t0 = time.monotonic()
        row = {"batch": len(lengths), "prompt_lengths": list(lengths), "new_tokens": new_tokens, "dtype": str(dtype),
               "compile_backend": backend.get("backend", "inductor")}
        try:
            B, T, capacity = len(lengths), max(lengths), max(lengths) + new_tokens
            gen = torch.Generator(device=ctx.device).manual_seed(1)
            hidden = layer.config.hidden_size
            x = torch.randn(B, T + new_tokens, hidden, generator=gen, device=ctx.device).to(dtype)
            lens = torch.tensor(lengths, device=ctx.device)
            caches = {k: LatentCache.from_config(m.config, B, capacity, dtype=d, device=ctx.device, fill=float("nan"))
                      for k, m, d in (("eager", layer, dtype), ("compiled", layer, dtype),
                                      ("reference", reference, torch.float32))}
            outs = {k: [] for k in caches}
            with torch.no_grad():
                for k, cache in caches.items():
                    module = reference if k == "reference" else layer
                    prompt = x[:, :T].float() if k == "reference" else x[:, :T]
                    module(prompt, cache, input_lengths=lens)
                for t in range(T, T + new_tokens):
                    x_t = x[:, t:t + 1]
                    outs["eager"].append(layer(x_t, caches["eager"]))
                    outs["compiled"].append(decode_one_token(layer, x_t, caches["compiled"], step=step))
                    outs["reference"].append(reference(x_t.float(), caches["reference"]))
            ref = torch.cat(outs["reference"], 1)
            errs = {k: float((torch.cat(outs[k], 1).float() - ref).abs().max()) for k in ("eager", "compiled")}
            ulp = torch.finfo(dtype).eps * float(ref.abs().max())
            row.update(eager_err=errs["eager"], compiled_err=errs["compiled"], err_budget=2 * errs["eager"] + 2 * ulp,
                       nan_free=not any(bool(torch.isnan(o).any()) for o in outs["compiled"]))
            row["passed"] = row["nan_free"] and row["compiled_err"] <= row["err_budget"]
        except Exception as e:
            row.update(passed=False, error=f"{type(e).__name__}: {e}")
        row["seconds"] = round(time.monotonic() - t0, 2)
        ctx.log(f"compiled step, batch {row['batch']}: {'ok' if row['passed'] else 'FAILED'}")
        rows.append(row)
    return rows


def run(ctx: PartContext) -> None:
    budget = ctx.time_left()
    ctx.record["tests"] = run_tests(ctx, TEST_SHARE * budget)
    ctx.save()
    run_kernel_checks(ctx, deadline_s=(1 - TEST_SHARE - KERNEL_SHARE) * budget)
    ctx.save()
    batches = {"1": (17,), "4": (17, 5, 40, 29)} if ctx.dry_run else {"1": (2000,), "4": (2000, 37, 4096, 811)}
    ctx.record["compiled_step"] = {"rows": check_compiled_step(ctx, batches)}
    kernel, steps = ctx.record["kernel"], ctx.record["compiled_step"]["rows"]
    ctx.record["checks_failed"] = (kernel["failed"] + sum(not r["passed"] for r in steps)
                                   + (ctx.record["tests"]["status"] == "failed"))
    tests_timed_out = ctx.record["tests"]["status"] == "timeout"
    if kernel["not_run"] or len(steps) < len(batches) or tests_timed_out:
        ctx.record["status"] = "partial"
        ctx.record["not_run"] = {"kernel_cases": kernel["not_run"], "compiled_step_batches": len(batches) - len(steps),
                                 "tests_timed_out": tests_timed_out}


def summarize(record: dict) -> list[str]:
    lines = []
    tests = record.get("tests")
    if tests:
        counts = tests.get("counts", {})
        lines.append(f"**CUDA tests** ({', '.join(tests.get('files', []))}): {tests['status']}"
                     + (f", {counts.get('tests', 0)} run, {counts.get('failures', 0)} failed, "
                        f"{counts.get('errors', 0)} errors, {counts.get('skipped', 0)} skipped" if counts else "")
                     + (f" ({tests['reason']})" if tests.get("reason") else ""))
        for f in tests.get("failures", [])[:20]:
            lines.append(f"- {f['kind']}: `{f['test']}`: {f['message'][:200]}")
        lines.append("")
    kernel = record.get("kernel")
    if kernel:
        lines.append(f"**Kernel against the spec** (d_c {kernel['shape']['d_c']}, d_r {kernel['shape']['d_r']}, "
                     f"lengths {kernel['shape']['lengths']}): {kernel.get('passed', 0)} passed, "
                     f"{kernel.get('failed', 0)} failed, {kernel.get('not_run', 0)} not run of {kernel['cases']}.")
        lines.append("")
        rows = [[r["heads"], r["page"], r["s_q"], r["kv_format"], r["norm"], sci(r.get("kernel_err")),
                 sci(r.get("err_budget")), sci(r.get("lse_err")), sci(r.get("lse_budget")), "yes" if r["passed"] else
                 f"**no** {r.get('error', '')}"] for r in kernel["rows"]]
        lines += table(["heads", "page", "S_q", "rows", "norm", "max err", "budget", "lse err", "lse budget",
                        "passed"], rows)
        lines.append("")
    step = record.get("compiled_step")
    if step:
        rows = [[r["batch"], r["prompt_lengths"], r["compile_backend"], sci(r.get("eager_err")),
                 sci(r.get("compiled_err")), sci(r.get("err_budget")),
                 "yes" if r["passed"] else f"**no** {r.get('error', '')}"] for r in step["rows"]]
        lines.append("**Compiled decode step** against the float32 layer:")
        lines.append("")
        lines += table(["batch", "prompt lengths", "compile", "eager err", "compiled err", "budget", "passed"], rows)
    return lines
