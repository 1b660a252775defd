"""Part 7 (with the time that is left): vLLM serving on the GPU. A QK-normed checkpoint served through
qkmla's plugin (its CUDA backend: TRITON_MLA's prefill, qkmla's Triton decode over rows widened by
the key scalars, CUDA graphs on) against a plain checkpoint of the same shapes served by stock vLLM
with TRITON_MLA and with FlashMLA: decode time per step and tokens/s at each context length and batch.

The models: one layer of DeepSeek-V3's attention widths (16 heads, d_c 512, d_r 64, d_n 128), bf16
(``REAL``); the QK-normed one RMS blockwise, 16 key scalars per token. Each arm is an engine in its
own process (``benchmarks.vllm_serving``'s decode worker: warm first, then one point per request,
the median engine step once every sequence has its first token, and the decode attention alone
within it, each layer's ``forward_mqa``). The arms take turns at each point. Ratios: qknorm's step
and attention time over each stock arm's, at each point. FlashMLA needs a Hopper or newer GPU; where
vLLM refuses an arm, its error is recorded and the others run.

Before the engines, the plugin's tests of its CUDA path that need no engine run on the GPU, in a
process of their own (``UNIT_TESTS``, recorded under "unit_tests", a failure among the errors): the
CUDA impl's Triton decode on CUDA tensors, vLLM's own cache op writing the wider row, and the cache
write and the decode captured in a CUDA graph and replayed; elsewhere those run in Triton's
interpreter or skip (the dry run selects only the GPU-only ones, which skip).

Needs vLLM built for CUDA (``pip install vllm``; qkmla's plugin states the releases it supports): on
a machine without vLLM the part is skipped, naming it. The dry run serves the same code paths on the
CPU at tiny shapes: the QK-normed arm through qkmla's CPU backend against vLLM's CPU_MLA (the GPU
backends are recorded as not run).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from ..common import ROOT
from .suite import PartContext, fmt, run_unit, table

SHAPE = dict(vocab_size=384, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=16,
             num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128)
DRY_SHAPE = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16)
REAL = dict(shape=SHAPE, dtype="bfloat16", contexts=(1024, 8192, 32768), batches=(1, 32), new_tokens=32, rounds=3,
            eager=False, max_num_seqs=32)
DRY = dict(shape=DRY_SHAPE, dtype="float32", contexts=(32,), batches=(1, 2), new_tokens=3, rounds=1, eager=True,
           max_num_seqs=2)
# The plugin's engine-free tests of its CUDA path, and the selection run on a GPU and in the dry run
# (there only the GPU-only tests: the others take minutes in Triton's interpreter and run in CI)
UNIT_TESTS = ("tests/integrations/vllm/test_backend.py", "tests/integrations/vllm/test_cuda_decode.py")
UNIT_SELECTION = {"gpu": "cuda or gpu or triton", "dry": "on_a_gpu"}
# (arm, checkpoint, --attention-backend on a GPU, on the CPU (None: not run there))
ARMS = (("qknorm", "qknorm", None, None), ("TRITON_MLA", "plain", "TRITON_MLA", "CPU_MLA"),
        ("FLASHMLA", "plain", "FLASHMLA", None))


def checkpoints(work: Path, shape: dict) -> dict:
    """The plain and the QK-normed checkpoint (RMS blockwise; random weights, norm weights from [0.5, 1.5])."""
    from qkmla import QKNormConfig

    from .. import vllm_serving

    return {"plain": vllm_serving.checkpoint(work / "plain", shape),
            "qknorm": vllm_serving.checkpoint(work / "qknorm", shape, qk_norm=QKNormConfig("rms"))}


def arms(ctx: PartContext) -> list[tuple[str, str, str]]:
    """(arm, checkpoint, backend) of each arm that runs on this device; the others in ``not_run``."""
    chosen = []
    for name, model, gpu, cpu in ARMS:
        backend = gpu if ctx.device.type == "cuda" else cpu
        if backend is None and name != "qknorm":
            ctx.record.setdefault("not_run", []).append(f"{name} (a GPU backend)")
            continue
        chosen.append((name, model, backend))
    return chosen


def start(ctx: PartContext, cfg: dict, name: str, model: Path, backend) -> "object":
    """One arm's decode engine, up and warm (``vllm_serving.DecodeWorker``)."""
    from .. import vllm_serving

    # the warm-up decodes prompts of 32 tokens for 8 more (vllm_serving.engine)
    longest = max(max(cfg["contexts"]) + cfg["new_tokens"] + 8, 48)
    spec = {"model": str(model), "dtype": cfg["dtype"], "max_model_len": longest,
            "warm_batch": max(cfg["batches"]), "new_tokens": cfg["new_tokens"], "eager": cfg["eager"],
            "max_num_seqs": cfg["max_num_seqs"], "max_num_batched_tokens": longest,
            "engine": {} if backend is None else {"attention_backend": backend}}
    worker = vllm_serving.DecodeWorker(spec, ctx.out / f"{ctx.stem}_{name}.log")
    worker.reply(f"starting the {name} arm")
    return worker


def unit_tests(ctx: PartContext) -> list:
    """pytest over ``UNIT_TESTS`` (``-k UNIT_SELECTION``) in a process of its own, with this checkout's
    src/ first on the path: the command, the counts of its summary line and the ids of the tests that
    failed, as the record's "unit_tests" (its log beside the record); RuntimeError if any failed."""
    selection = UNIT_SELECTION["dry" if ctx.dry_run else "gpu"]
    # pyproject's addopts replaced: its -q beside this one would drop the summary line read below
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=--import-mode=importlib", "-q",
               "-rfE", "-k", selection, *UNIT_TESTS]
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=max(60.0, min(600.0, ctx.time_left())))
    (ctx.out / f"{ctx.stem}_unit_tests.log").write_text(done.stdout + done.stderr)
    ends = [line.strip("= ") for line in done.stdout.splitlines()
            if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b|no tests ran", line)]
    summary = ends[-1] if ends else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", summary)}
    result = {"command": " ".join(["python", *command[1:]]), "exit": done.returncode, "summary": summary,
              "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
              "skipped": counts.get("skipped", 0), "errors": counts.get("error", 0) + counts.get("errors", 0),
              "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, flags=re.MULTILINE)}
    ctx.record["unit_tests"] = result
    if done.returncode not in (0, 5) or result["failed"] or result["errors"]:  # 5: every test deselected
        raise RuntimeError(f"{summary or 'no summary'} (exit {done.returncode}): {result['failures']}")
    return []  # no rows: the timed rows are the arms'


def run(ctx: PartContext) -> None:
    if ctx.skipped_without("vllm", "pip install vllm, a CUDA build of a release qkmla's plugin supports: "
                                   "docs/serving.md"):
        return
    import tempfile

    cfg = DRY if ctx.dry_run else REAL
    ctx.record.update(config={k: v for k, v in cfg.items() if k != "shape"}, shape=cfg["shape"], rows=[])
    run_unit(ctx, "the plugin's CUDA-path tests", lambda: unit_tests(ctx))
    work = Path(tempfile.mkdtemp(prefix="qkmla-vllm-part-"))
    models = checkpoints(work, cfg["shape"])
    workers = {}
    for name, model, backend in arms(ctx):
        def started(name=name, model=model, backend=backend):
            workers[name] = start(ctx, cfg, name, models[model], backend)
            return []
        run_unit(ctx, f"start {name}", started)
    try:
        samples: dict = {}
        points = [(c, b) for c in cfg["contexts"] for b in cfg["batches"]]
        for round_ in range(cfg["rounds"]):
            for context, batch in points:
                if ctx.out_of_time(reserve_s=0 if ctx.dry_run else 30):
                    ctx.record.setdefault("not_run", []).append(f"round {round_}, context {context}, batch {batch}")
                    ctx.record["status"] = "partial"
                    continue
                names = list(workers)
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # the order rotates
                    def measured(name=name, context=context, batch=batch):
                        samples.setdefault((name, context, batch), []).append(workers[name].measure(context, batch))
                        return []
                    run_unit(ctx, f"{name} at {context} x {batch}", measured)
        ctx.record["rows"] = rows_of(samples)
        ctx.save()
    finally:
        for worker in workers.values():
            worker.close()


def rows_of(samples: dict) -> list[dict]:
    """One row per arm and point, medians over rounds; qknorm's ratios to each stock arm."""
    rows = []
    for (name, context, batch), got in samples.items():
        rows.append({"arm": name, "context": context, "batch": batch, "rounds": len(got),
                     "kv_bytes_per_token_per_layer": got[0]["kv_bytes_per_token_per_layer"],
                     "median_step_ms": statistics.median(g["median_step_ms"] for g in got),
                     "median_attention_ms": statistics.median(g["median_attention_ms"] for g in got),
                     "decode_tokens_per_s": statistics.median(g["decode_tokens_per_s"] for g in got)})
    by = {(r["arm"], r["context"], r["batch"]): r for r in rows}
    for r in rows:
        if r["arm"] == "qknorm":
            for stock in ("TRITON_MLA", "FLASHMLA"):
                other = by.get((stock, r["context"], r["batch"]))
                r[f"step_over_{stock}"] = r["median_step_ms"] / other["median_step_ms"] if other else None
                r[f"attention_over_{stock}"] = (r["median_attention_ms"] / other["median_attention_ms"]
                                                if other and other["median_attention_ms"] else None)
    return rows


def summarize(record: dict) -> list[str]:
    if record.get("status") == "skipped":
        return [f"- skipped: {record.get('reason')}"]
    body = [[r["arm"], r["context"], r["batch"], r["kv_bytes_per_token_per_layer"], fmt(r["median_step_ms"], 3),
             fmt(r["median_attention_ms"], 3), fmt(r["decode_tokens_per_s"], 0),
             fmt(r.get("step_over_TRITON_MLA"), 3), fmt(r.get("step_over_FLASHMLA"), 3)]
            for r in sorted(record.get("rows", []), key=lambda r: (r["context"], r["batch"], r["arm"]))]
    unit = record.get("unit_tests")
    tested = [f"- the plugin's CUDA-path tests (`{unit['command']}`): {unit['summary']}", ""] if unit else []
    lines = tested + table(["arm", "context", "batch", "KV bytes / token", "step ms", "attention ms", "tokens/s",
                   "step over TRITON_MLA", "step over FLASHMLA"], body)
    for e in record.get("errors", []):
        lines.append(f"- error: {e}")
    if record.get("not_run"):
        lines.append(f"- not run: {', '.join(record['not_run'])}")
    return lines
