"""vLLM serving on the CPU: QK-normed MLA through qkmla's plugin, side by side with plain MLA.

Three parts, one results file (``benchmarks/results/vllm_serving_cpu.json``):

* ``drift``: greedy tokens and the logprob of every sampled token against qkmla's own
  generation (transformers + latent cache, float32), for a tiny QK-normed model served in
  float32 and bfloat16, and for a plain model served by stock vLLM (rotary custom op off,
  ``custom_ops=["none"]``, see docs/serving.md) in float32 and bfloat16 against transformers.
* ``trained``: the same comparison for a model trained here: a DeepSeek-V3-architecture model
  with RMS QK-norm (d_c + d_r = 320, vLLM's smallest latent width) trained from scratch for a
  few CPU minutes on the embedded Shakespeare's byte tokens (ByT5's ids), greedy-decoded from
  lines of the held-out plays.
* ``decode``: decode tokens/s and KV bytes per token at each context length and batch, for
  three one-layer models of DeepSeek's attention widths (16 heads, d_c 512, d_r 64) served
  the same way: ``stock`` (a plain checkpoint: vLLM's CPU_MLA with its C++ decode kernel),
  ``plain-qkmla`` (plain MLA through qkmla's backend: a checkpoint whose record holds only a
  per-head logit scale, set to vLLM's tau, so the same function as plain) and ``qknorm``
  (RMS blockwise QK norm, 16 key scalars per token). Decode time per token is the median
  engine step once every sequence has its first token (each such step decodes one token for
  every sequence; the prefill steps are not timed), and within it the decode attention alone
  (each layer's ``forward_mqa``: the read of the cache, where the key scalars' bytes are).
  Each variant's engine stays up in its own process and measures one point at a time, the
  three taking turns at each point (the order rotated every round), so that the measurements
  a ratio pairs are taken within about a minute of each other; ``--rounds`` rounds, shared
  among ``--sessions`` sets of fresh processes (on a small VM a process's speed varies with
  where its memory lands, so sessions matter more than rounds). A point's time is its median
  over rounds; qknorm's ratios to plain-qkmla and to stock are the
  medians of the per-round ratios. Engines run as ``vllm serve`` does, under vLLM's default
  compilation (``--eager``: ``enforce_eager=True`` instead). Every engine prefills through
  qkmla's fused-SDPA prefill (``backend.cpu_prefill_backend``; for ``stock`` by overriding
  vLLM's CPU prefill in its process): vLLM's own materializes [h, T, T] float32 scores, 17 GB
  at 16k tokens. Only decode steps are timed, and stock's decode is its own C++ kernel.

Each engine runs in its own process. Timings are wall-clock on whatever machine runs this;
compare them only within one run.

    python -m benchmarks.vllm_serving --out benchmarks/results/vllm_serving_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import byte_plays, claim_work_dirs, settings_of, start_record

DRIFT_SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
                   v_head_dim=16)
DECODE_SHAPE = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=16,
                    num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                    v_head_dim=32)
DRIFT_PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21]]
TRAINED_SHAPE = dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=64,
                     v_head_dim=32)
TRAINED_PROMPTS = ["ROMEO:\nBut soft, what light", "First Citizen:\nWe are accounted poor", "KING"]


def randomize(model, **record):
    """Weights drawn large enough that attention is far from uniform, then ``record`` (apply_latent_attention's
    norm arguments; none: plain) applied, its norm weights drawn from [0.5, 1.5] and any logit scale spread over
    0.8 to 1.6 times tau. The draws continue torch's global generator: seed it before building the model."""
    import torch

    from qkmla.integrations.transformers import apply_latent_attention

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        if record:
            apply_latent_attention(model, **record)
            for name, p in model.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith("logit_scale"):
                    p.mul_(torch.linspace(0.8, 1.6, p.numel()))
    return model.eval()


def checkpoint(path: Path, shape: dict, **record) -> Path:
    """A random DeepSeek-V3 checkpoint (dense MLPs) saved by qkmla; ``record``: apply_latent_attention's norm."""
    import torch

    torch.manual_seed(0)
    randomize(_untrained(shape), **record).save_pretrained(path)
    return path


def engine(spec: dict) -> dict:
    """Run one engine (in this process) as ``spec`` says: with ``"prompts"``, generate them and return
    tokens and logprobs (:func:`run_engine`); without, serve decode points read from stdin until it
    closes (:class:`DecodeWorker`), returning nothing more."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    if spec.get("qkmla_prefill"):  # a plain model's prefill in O(T) memory; its decode stays vLLM's
        from vllm.v1.attention.backends.mla.prefill.registry import (MLAPrefillBackendEnum,
                                                                     register_mla_prefill_backend)

        register_mla_prefill_backend(MLAPrefillBackendEnum.CPU,
                                     "qkmla.integrations.vllm.backend.QKMLACPUPrefillBackend")
    llm = LLM(spec["model"], dtype=spec["dtype"], enforce_eager=spec.get("eager", True), gpu_memory_utilization=0.2,
              max_model_len=spec["max_model_len"], skip_tokenizer_init=True, seed=0,
              distributed_executor_backend="uni", max_num_batched_tokens=spec.get("max_num_batched_tokens"),
              max_num_seqs=spec.get("max_num_seqs", 8), **spec.get("engine", {}))

    def generate(prompts, tokens):
        params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=0, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    if "prompts" in spec:  # drift
        outs = generate(spec["prompts"], spec["max_tokens"])
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]}
    import torch

    config = llm.llm_engine.vllm_config

    def row_bytes(model) -> int:
        """Bytes per token of the first attention layer's cache, from the spec vLLM allocates by."""
        from vllm.model_executor.layers.attention import MLAAttention

        layer = next(m for m in model.modules() if isinstance(m, MLAAttention))
        spec = layer.get_kv_cache_spec(config)
        return spec.page_size_bytes // spec.block_size

    bytes_per_token = llm.apply_model(row_bytes)[0]
    if not llm.apply_model(time_decode_attention)[0]:
        raise RuntimeError(f"{spec['model']}: no MLA attention layer found to time")
    # Warm: the first decode steps at each batch size run slower (compilation, first touches).
    for batch in sorted({1, spec["warm_batch"]}):
        decode_steps(llm, [[2] * 32] * batch, 8, SamplingParams)
    # A decode worker: ready, then one point per line of stdin, its row on a tagged line of stdout
    # (vLLM logs there too).
    print(RESULT_TAG + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        context, batch = json.loads(line)
        g = torch.Generator().manual_seed(context * 1000 + batch)  # the same prompts for every variant and round
        prompts = [torch.randint(2, 384, (context,), generator=g).tolist() for _ in range(batch)]
        steps, attention = decode_steps(llm, prompts, spec["new_tokens"], SamplingParams)
        step_s = statistics.median(steps)
        row = {"context": context, "batch": batch, "kv_bytes_per_token_per_layer": bytes_per_token,
               "decode_steps_timed": len(steps), "median_step_ms": round(1e3 * step_s, 3),
               "median_attention_ms": round(1e3 * statistics.median(attention), 3),
               "decode_tokens_per_s": round(batch / step_s, 2)}
        print(RESULT_TAG + json.dumps(row), flush=True)
    return {}


ATTENTION_S: list = []  # seconds of each decode-attention call (forward_mqa) in this process, once timed


def time_decode_attention(model) -> int:
    """Time every attention layer's decode over the cache (its impl's ``forward_mqa``: qkmla's
    decode op, or vLLM's C++ kernel for stock) into ATTENTION_S; runs in the engine's worker, which
    is this process (one process, the uni executor)."""
    from vllm.model_executor.layers.attention import MLAAttention

    def timed(forward_mqa):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = forward_mqa(*args, **kwargs)
            ATTENTION_S.append(time.perf_counter() - t0)
            return out
        return run

    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    for layer in layers:
        layer.impl.forward_mqa = timed(layer.impl.forward_mqa)
    return len(layers)


def decode_steps(llm, prompts, new_tokens: int, sampling_params) -> tuple[list, list]:
    """Seconds of each engine step after every prompt has its first token (each such step is one
    decode token for every sequence; the prefill steps before are not timed), and of the decode
    attention within it (summed over layers; zeros unless :func:`time_decode_attention` ran)."""
    engine = llm.llm_engine
    params = sampling_params(max_tokens=1 + new_tokens, temperature=0, ignore_eos=True)
    tag = f"{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    started, times, attention = set(), [], []
    while engine.has_unfinished_requests():
        all_started, calls = len(started) == len(prompts), len(ATTENTION_S)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if all_started and any(o.outputs and not o.finished for o in outs):
            times.append(dt)
            attention.append(sum(ATTENTION_S[calls:]))
        started.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
    return times, attention


def run_engine(spec: dict) -> dict:
    """:func:`engine` in a fresh process; the JSON it prints on its last line."""
    run = subprocess.run([sys.executable, "-m", __spec__.name, "--engine", json.dumps(spec)], capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())})
    if run.returncode != 0:
        raise RuntimeError(f"engine {spec.get('model')} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


RESULT_TAG = "qkmla-decode-row "


class DecodeWorker:
    """One decode engine (:func:`engine`) kept in its own process between points, so that the
    variants can take turns point by point; its log (vLLM's output) goes to ``log``."""

    def __init__(self, spec: dict, log: Path):
        self.name, self.log = spec["model"], log
        self.log_file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "--engine", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())})

    def measure(self, context: int, batch: int) -> dict:
        try:
            self.proc.stdin.write(json.dumps([context, batch]) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the engine has exited (or was closed): reply() says so, naming its log
            pass
        return self.reply(f"measuring context {context}, batch {batch}")

    def reply(self, doing: str):
        """The next tagged line: "ready" once the engine is up and warm, then a row per point
        (the tag is looked for anywhere in a line: output without a newline may precede it)."""
        for line in () if self.proc.stdout.closed else self.proc.stdout:
            if RESULT_TAG in line:
                return json.loads(line[line.index(RESULT_TAG) + len(RESULT_TAG):])
        self.close()
        raise RuntimeError(f"engine {self.name} exited (code {self.proc.returncode}) before {doing}; "
                           f"its log: {self.log}")

    def close(self) -> None:
        """End the engine (its stdin closed ends its loop); killed if it has not exited in a minute."""
        try:
            self.proc.stdin.close()
        except OSError:  # already gone: the unsent line cannot be flushed
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.log_file.close()


def reference(model_dir: Path, plain: bool, prompts=DRIFT_PROMPTS, new_tokens: int = 12) -> dict:
    """qkmla's generation in float32 (transformers + latent cache), or transformers' own for a plain model."""
    import torch
    import transformers

    from qkmla.integrations.transformers import from_pretrained

    model = (transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if plain
             else from_pretrained(model_dir)).eval()
    tokens, logprobs = [], []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        new = out.sequences[0, len(p):].tolist()
        tokens.append(new)
        logprobs.append([torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, new)])
    return {"tokens": tokens, "logprobs": logprobs}


def compare(got: dict, want: dict) -> dict:
    """Tokens equal up to the first divergence, and the logprob drift over the matching prefix."""
    same, worst = 0, 0.0
    for g, w, gl, wl in zip(got["tokens"], want["tokens"], got["logprobs"], want["logprobs"]):
        for a, b, x, y in zip(g, w, gl, wl):
            worst = max(worst, abs(x - y))  # the token at a divergence is compared too, then stop
            if a != b:
                break
            same += 1
    total = sum(len(w) for w in want["tokens"])
    return {"tokens_equal": got["tokens"] == want["tokens"], "tokens_matching_before_divergence": f"{same}/{total}",
            "max_abs_logprob_diff": worst}


def drift(work: Path, result: dict, write) -> None:
    qk = checkpoint(work / "drift-qknorm", DRIFT_SHAPE, qk_norm="rms")
    plain = checkpoint(work / "drift-plain", DRIFT_SHAPE)
    want = {"qknorm": reference(qk, plain=False), "plain": reference(plain, plain=True)}
    stock_fix = {"compilation_config": {"custom_ops": ["none"]}}
    for name, model, engine_args in (("qknorm via qkmla", qk, {}), ("plain via stock vLLM", plain, stock_fix),
                                     ("plain via stock vLLM, rotary custom op on", plain, {})):
        for dtype in ("float32", "bfloat16"):
            got = run_engine({"model": str(model), "dtype": dtype, "max_model_len": 128, "prompts": DRIFT_PROMPTS,
                              "max_tokens": 12, "engine": engine_args})
            row = {"model": name, "dtype": dtype, **compare(got, want["plain" if "plain" in name else "qknorm"])}
            result["drift"].append(row)
            print(json.dumps(row), flush=True)
            write()


def trained(work: Path, result: dict, write, steps: int) -> None:
    """Train a QK-normed model here, then serve it: tokens and logprob drift against qkmla's generation."""
    import torch
    import transformers

    from qkmla.integrations.transformers import apply_latent_attention

    tokenizer = transformers.ByT5Tokenizer()
    train_ids, val_ids = byte_plays(tokenizer)
    model_dir = work / "trained-qknorm"
    model = _untrained(TRAINED_SHAPE)
    apply_latent_attention(model, qk_norm="rms")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    block, batch = 128, 16
    val = torch.stack([val_ids[i:i + block] for i in range(0, 32 * block, block)])

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=val, labels=val, use_cache=False).loss.item()
        model.train()
        return round(loss, 4)

    start, t0 = val_loss(), time.perf_counter()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - block, (batch,), generator=g)
        x = torch.stack([train_ids[s:s + block] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(model_dir)
    result["trained"] = {"shape": TRAINED_SHAPE, "steps": steps, "batch": batch, "block": block,
                         "optimizer": "AdamW lr 3e-3 (20 warmup steps, linear to 0.1x), wd 0.1, clip 1.0",
                         "val_loss_before": start, "val_loss_after": val_loss(),
                         "train_wall_s": round(time.perf_counter() - t0, 1), "rows": []}
    write()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in TRAINED_PROMPTS]
    want = reference(model_dir, plain=False, prompts=prompts, new_tokens=24)
    for dtype in ("float32", "bfloat16"):
        got = run_engine({"model": str(model_dir), "dtype": dtype, "max_model_len": 128, "prompts": prompts,
                          "max_tokens": 24})
        row = {"dtype": dtype, **compare(got, want),
               "text": [tokenizer.decode(t, skip_special_tokens=True) for t in got["tokens"]]}
        result["trained"]["rows"].append(row)
        print(json.dumps(row), flush=True)
        write()


def _untrained(shape: dict):
    """A freshly initialized DeepSeek-V3 model with dense MLPs, of ``shape``."""
    import transformers

    cfg = transformers.DeepseekV3Config(**shape, n_routed_experts=4, first_k_dense_replace=shape["num_hidden_layers"],
                                        max_position_embeddings=32768, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return transformers.DeepseekV3ForCausalLM(cfg)


def kv_bytes_per_token(shape: dict, scalars: int, dtype_bytes: int) -> int:
    """One layer's cache row: d_c + d_r (+ G key scalars) values."""
    return (shape["kv_lora_rank"] + shape["qk_rope_head_dim"] + scalars) * dtype_bytes


def decode(work: Path, result: dict, write, grid, new_tokens: int, dtype: str, rounds: int, sessions: int,
           eager: bool) -> None:
    from qkmla import QKNormConfig

    tau = DECODE_SHAPE["qk_nope_head_dim"] + DECODE_SHAPE["qk_rope_head_dim"]
    models = {"stock": (checkpoint(work / "decode-plain", DECODE_SHAPE), 0),
              "plain-qkmla": (checkpoint(work / "decode-plain-qkmla", DECODE_SHAPE,
                                         qk_norm=QKNormConfig(None, learnable_logit_scale=True)), 0),
              "qknorm": (checkpoint(work / "decode-qknorm", DECODE_SHAPE, qk_norm="rms"),
                         DECODE_SHAPE["num_attention_heads"])}
    _set_logit_scale(models["plain-qkmla"][0], tau ** -0.5)  # the same function as plain MLA
    longest = max(c for c, _ in grid) + new_tokens + 1
    size = 2 if dtype == "bfloat16" else 4
    names = list(models)
    for session in range(sessions):  # fresh engine processes: a process's own luck (memory placement) is shared out
        workers = {}
        try:
            for name, (model, _) in models.items():
                spec = {"model": str(model), "dtype": dtype, "max_model_len": longest, "eager": eager,
                        "new_tokens": new_tokens, "max_num_batched_tokens": longest * max(b for _, b in grid),
                        "qkmla_prefill": name == "stock", "warm_batch": max(b for _, b in grid)}
                workers[name] = DecodeWorker(spec, work / f"engine-{name}-session{session}.log")
            for worker in workers.values():  # the engines start together, and are timed only once all are up
                worker.reply("starting")
            for round_ in range(session * rounds // sessions, (session + 1) * rounds // sessions):
                for context, batch in grid:
                    # The variants in turn at each point, the order rotated every round: a slow spell of
                    # the machine lands on all of them, and on each in every position.
                    for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                        row = workers[name].measure(context, batch)
                        result["decode_runs"].append({"variant": name, "session": session, "round": round_, **row})
                        write()
        finally:
            for worker in workers.values():
                worker.close()
    summarize_decode(result, models, size)


def summarize_decode(result: dict, models: dict, size: int) -> None:
    """Per variant and point: the median over rounds of each engine's median step; the paired
    ratios (qknorm over plain-qkmla and over stock, each round's measurements taken in turn)."""
    runs = {}
    for row in result["decode_runs"]:
        runs.setdefault((row["variant"], row["context"], row["batch"]), {})[row["round"]] = row

    def median(by: dict, field: str) -> float:
        return statistics.median(r[field] for r in by.values())

    result["decode"] = [{"variant": v, "kv_bytes_per_token_per_layer": _row_bytes(by),
                         "kv_bytes_expected": kv_bytes_per_token(DECODE_SHAPE, models[v][1], size), "context": c,
                         "batch": b, "rounds": len(by), "median_step_ms": round(median(by, "median_step_ms"), 3),
                         "fastest_step_ms": min(r["median_step_ms"] for r in by.values()),
                         "median_attention_ms": round(median(by, "median_attention_ms"), 3),
                         "decode_tokens_per_s": round(b / median(by, "median_step_ms") * 1e3, 2)}
                        for (v, c, b), by in runs.items()]
    result["ratios"] = ratios(runs)


def _set_logit_scale(model_dir: Path, tau: float) -> None:
    """Overwrite the saved per-head logit scales with tau (the checkpoint then computes plain MLA)."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(f)
        hit = {k: torch.full_like(v, tau) for k, v in tensors.items() if k.endswith("logit_scale")}
        if hit:
            save_file({**tensors, **hit}, f, metadata={"format": "pt"})


def _row_bytes(by_round: dict) -> int:
    """The cache row's bytes per token and layer of one variant's rounds (the same in every round)."""
    return next(iter(by_round.values()))["kv_bytes_per_token_per_layer"]


def ratios(runs: dict) -> list:
    """qknorm / plain-qkmla and qknorm / stock decode time at each point, paired by round:
    runs[(variant, context, batch)][round] is a row of ``decode_runs``."""
    out = []
    for (v, c, b), qk in runs.items():
        if v != "qknorm" or ("plain-qkmla", c, b) not in runs:
            continue

        def paired(other: str, field: str = "median_step_ms") -> list:
            theirs = runs.get((other, c, b), {})
            return [round(qk[k][field] / theirs[k][field], 4) for k in sorted(qk) if theirs.get(k, {}).get(field)]

        plain, stock = paired("plain-qkmla"), paired("stock")
        attention = paired("plain-qkmla", "median_attention_ms")
        row_ratio = _row_bytes(qk) / _row_bytes(runs[("plain-qkmla", c, b)])
        out.append({"context": c, "batch": b, "qknorm_over_plain_qkmla_time_by_round": plain,
                    "qknorm_over_plain_qkmla_time": round(statistics.median(plain), 3),
                    "extra_bytes": round(row_ratio - 1, 4),
                    # the target: QK-normed decode within its extra bytes plus 2% of plain's time
                    "within_target": statistics.median(plain) <= row_ratio + 0.02,
                    # the decode attention alone (forward_mqa: reading the cache), which the extra bytes bear on
                    "qknorm_over_plain_qkmla_attention_time": round(statistics.median(attention), 3)
                    if attention else None,
                    "attention_within_target": statistics.median(attention) <= row_ratio + 0.02 if attention else None,
                    "qknorm_over_stock_time_by_round": stock,
                    "qknorm_over_stock_time": round(statistics.median(stock), 3) if stock else None})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="results JSON (written after every engine)")
    parser.add_argument("--work", type=Path, default=Path("runs/vllm_serving"), help="checkpoints go here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6,
                        help="measurements of each point per variant, the variants in turn; medians and paired ratios")
    parser.add_argument("--sessions", type=int, default=2,
                        help="fresh engine processes per variant, the rounds shared among them")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--eager", action="store_true",
                        help="decode engines with enforce_eager=True (default: vLLM's default compilation, as served)")
    parser.add_argument("--parts", nargs="+", choices=["drift", "trained", "decode"],
                        default=["drift", "trained", "decode"])
    parser.add_argument("--train-steps", type=int, default=600, help="the trained part's optimizer steps")
    parser.add_argument("--overwrite", action="store_true", help="replace --out and --work if they exist")
    args = parser.parse_args(argv)
    if args.engine:
        print(json.dumps(engine(json.loads(args.engine))))
        return
    for name in ("contexts", "batches"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name}: expected positive integers, got {getattr(args, name)}")
    for name in ("new_tokens", "rounds", "sessions", "train_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if args.sessions > args.rounds:
        parser.error(f"--sessions: expected at most --rounds ({args.rounds}) sessions, got {args.sessions}")
    result, write = start_record(parser, args, __spec__.name, argv, status="running", settings=settings_of(args))
    import transformers
    import vllm

    claim_work_dirs(parser, [args.work], args.overwrite)
    args.work.mkdir(parents=True)
    result.update(transformers=transformers.__version__, vllm=vllm.__version__, drift=[], decode_runs=[], decode=[])
    if "drift" in args.parts:
        drift(args.work, result, write)
    if "trained" in args.parts:
        trained(args.work, result, write, args.train_steps)
    if "decode" in args.parts:
        grid = [(c, b) for c in args.contexts for b in args.batches]
        decode(args.work, result, write, grid, args.new_tokens, args.dtype, args.rounds, args.sessions, args.eager)
    result["status"] = "done"
    write()
    print(json.dumps(result.get("ratios", result["drift"]), indent=1))


if __name__ == "__main__":
    main()
