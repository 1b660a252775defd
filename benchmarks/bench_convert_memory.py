"""Peak memory of ``qkmla convert`` on a many-shard checkpoint: streamed against the whole model in memory.

    python -m benchmarks.bench_convert_memory --out benchmarks/results/convert_memory_cpu.json

A random DeepSeek-V3 checkpoint (bfloat16, MoE layers, ``--shard-mb`` shards) is written by a
process of its own; then, each in a fresh process whose peak resident memory (``ru_maxrss``) the
kernel reports when it exits:

* ``baseline``: importing torch, transformers and qkmla's converter, and nothing else;
* ``streamed``: ``qkmla convert --hf SRC --out DST --qk-norm rms`` (one shard or one decoder
  layer at a time: ``qkmla.convert.stream``);
* ``in_memory``: what converting did before it streamed, and what a transformers user would write:
  the whole model loaded (``from_pretrained``), patched, calibrated on the same tokens
  (``warm_start_qk_norm``) and saved.

The record gives each peak, and the streamed peak above the baseline in units of the checkpoint's
largest decoder layer and largest shard: the design's bound is about one of each (twice one layer
while transformers merges a layer's experts), whatever the number of layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, positive, start_record

BUILD = """
import sys, torch, transformers
layers, hidden, experts, moe, shard, vocab = (int(a) for a in sys.argv[2:8])
config = transformers.DeepseekV3Config(
    vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=moe,
    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=384,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=experts, num_experts_per_tok=4,
    n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096,
    pad_token_id=0, bos_token_id=None, eos_token_id=None)
torch.manual_seed(0)
with torch.device("meta"):
    model = transformers.DeepseekV3ForCausalLM(config)
model = model.to_empty(device="cpu").to(torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
model.save_pretrained(sys.argv[1], max_shard_size=f"{shard}MB")
transformers.ByT5Tokenizer().save_pretrained(sys.argv[1])
"""

BASELINE = "import torch, transformers, qkmla.convert.stream, qkmla.integrations.transformers.load"

IN_MEMORY = """
import sys, torch, transformers
from qkmla.convert import warm_start_qk_norm
from qkmla.convert.qk_norm import calibration_batches
from qkmla.integrations.transformers import apply_latent_attention, from_pretrained
from qkmla.train.data import load_text
src, out, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = transformers.AutoTokenizer.from_pretrained(src)
model = apply_latent_attention(from_pretrained(src), qk_norm="rms")
cal, held = calibration_batches(tokenizer, load_text("shakespeare"), tokens, model.config.max_position_embeddings)
warm_start_qk_norm(model, cal, held_out_ids=held)
model.save_pretrained(out)
"""


def peak_rss(argv: list[str]) -> dict:
    """Run ``argv`` to completion: its peak resident memory (bytes, the kernel's ``ru_maxrss``) and seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed:\n{output[-3000:]}")
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "seconds": round(time.perf_counter() - started, 1)}


def checkpoint_sizes(path: Path) -> dict:
    """Total, largest shard and largest decoder layer of a checkpoint, in bytes (from the safetensors headers)."""
    from qkmla.convert.stream import _sizes

    shards = sorted(path.glob("*.safetensors"))
    layers: dict[str, int] = {}
    total = 0
    for shard in shards:
        for name, size in _sizes(shard).items():
            total += size
            if name.startswith("model.layers."):
                key = name.split(".")[2]
                layers[key] = layers.get(key, 0) + size
    return {"bytes": total, "shards": len(shards), "largest_shard_bytes": max(s.stat().st_size for s in shards),
            "largest_layer_bytes": max(layers.values()), "layers": len(layers)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=positive, default=12, help="decoder layers (the first dense, the rest MoE)")
    p.add_argument("--hidden", type=positive, default=1024)
    p.add_argument("--experts", type=positive, default=32, help="routed experts per MoE layer")
    p.add_argument("--moe-intermediate", type=positive, default=512)
    p.add_argument("--vocab", type=positive, default=32000)
    p.add_argument("--shard-mb", type=positive, default=64, help="the source's shard size (MB)")
    p.add_argument("--calibration-tokens", type=positive, default=512)
    p.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--out", type=Path, help="the JSON record")
    p.add_argument("--overwrite", action="store_true", help="replace --out")
    args = p.parse_args(argv)
    if args.calibration_tokens < 16:
        p.error(f"--calibration-tokens: expected at least 16, got {args.calibration_tokens}")
    record, write = start_record(p, args, "benchmarks.bench_convert_memory", argv,
                                 settings={k: v for k, v in vars(args).items() if k not in ("out", "overwrite", "work")},
                                 status="running")
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        src, streamed, in_memory = (Path(scratch) / name for name in ("src", "streamed", "in_memory"))
        python = sys.executable
        record["build"] = peak_rss([python, "-c", BUILD, str(src), str(args.layers), str(args.hidden),
                                    str(args.experts), str(args.moe_intermediate), str(args.shard_mb), str(args.vocab)])
        record["checkpoint"] = checkpoint_sizes(src)
        print(json.dumps(record["checkpoint"]), flush=True)
        record["baseline"] = peak_rss([python, "-c", BASELINE])
        record["streamed"] = peak_rss([python, "-m", "qkmla", "convert", "--hf", str(src), "--out", str(streamed),
                                       "--qk-norm", "rms", "--calibration-tokens", str(args.calibration_tokens)])
        write()
        record["in_memory"] = peak_rss([python, "-c", IN_MEMORY, str(src), str(in_memory),
                                        str(args.calibration_tokens)])
    base, ck = record["baseline"]["peak_rss_bytes"], record["checkpoint"]
    above = record["streamed"]["peak_rss_bytes"] - base
    record["summary"] = {
        "streamed_above_baseline_bytes": above,
        "streamed_above_baseline_in_largest_layers": round(above / ck["largest_layer_bytes"], 2),
        "streamed_above_baseline_in_largest_shards": round(above / ck["largest_shard_bytes"], 2),
        "in_memory_above_baseline_in_checkpoints": round((record["in_memory"]["peak_rss_bytes"] - base) / ck["bytes"], 2),
        "streamed_over_in_memory_peak": round(record["streamed"]["peak_rss_bytes"] / record["in_memory"]["peak_rss_bytes"], 3),
    }
    record["status"] = "done"
    print(json.dumps(record["summary"], indent=1))
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
