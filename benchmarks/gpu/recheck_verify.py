"""Recheck on a GPU after the shared-memory and TF32 fixes (not a suite part); the script of
benchmarks/results/gpu/nvidia-h100-80gb-hbm3/recheck/, its imports now the package's:

    OUT=<dir> python -m benchmarks.gpu.recheck_verify
"""
import json
import os
import time
from pathlib import Path

import torch

from qkmla.ops.mla_decode import triton_kernel as tk

from . import part_correctness as pc
from . import part_kernel as pk
from . import suite

out_dir = Path(os.environ["OUT"])
res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "correctness": [], "kernel": [], "errors": []}
DRY = os.environ.get("DRY") == "1"
dev = torch.device("cpu" if DRY else "cuda")
CS, KS = (pc.DRY, pk.DRY) if DRY else (pc.REAL, pk.REAL)
if DRY:
    ctx_dry = True
def save():
    res["fitting"] = {str(k[1:]): tk.LAUNCH_CONFIGS[v] for k, v in tk._fitting.items()}
    (out_dir / "verify.json").write_text(json.dumps(res, indent=1, default=str))
for H, page, s_q, fmt, norm in [(128, 64, 2, "fp8", "blockwise"), (128, 16, 1, "dense", "plain"),
                                (128, 64, 1, "dense", "unified"), (128, 16, 2, "int8", "blockwise"),
                                (16, 16, 1, "int4", "blockwise"), (128, 64, 1, "int4", "unified")]:
    t0 = time.monotonic()
    scaled, mode = pc.NORMS[norm]
    try:
        args = pc.kernel_inputs(CS, H // 16 if DRY else H, page, s_q, fmt, scaled, dev)
        row = {"case": [H, page, s_q, fmt, norm], **pc.check_kernel_case(args, mode)}
    except Exception as e:
        row = {"case": [H, page, s_q, fmt, norm], "passed": False, "error": f"{type(e).__name__}: {e}"}
    row["seconds"] = round(time.monotonic() - t0, 1)
    print(row, flush=True); res["correctness"].append(row); save()
    torch.cuda.empty_cache()
ctx = suite.PartContext("kernel", Path("/tmp/k.json"), DRY, 300.0, dev)
peak, source = suite.hbm_peak(dev)
ctx.record.update(peak_bytes_per_s=peak, copy_bytes_per_s=suite.copy_bandwidth(ctx))
for H, context, batch in [(128, 4096, 1), (128, 65536, 16), (16, 65536, 16), (128, 262144, 1)]:
    try:
        rows = pk.kernel_rows(ctx, KS, H // 16 if DRY else H, 64 if DRY else context, batch)
        res["kernel"] += rows
        for r in rows:
            print(H, context, batch, r["variant"], round(r["us"], 1), r["roofline_pct"], r["launch"], flush=True)
    except Exception as e:
        res["errors"].append(f"{H} {context} {batch}: {type(e).__name__}: {e}"); print(res["errors"][-1], flush=True)
    res["derived"] = pk.derived(res["kernel"]); save()
    torch.cuda.empty_cache()
