"""QK-norm added to a trained transformers DeepSeek-V3 model, end to end, on a CPU in minutes.

    python -m benchmarks.hf_qknorm_recipe [--threads 1] [--work runs/hf_qknorm_recipe]
                                          [--out FILE.json] [--overwrite] [--quick]

1. source       a small DeepSeek-V3-architecture model (MLA with q_lora_rank and kv_lora_rank,
                one dense layer then MoE layers of routed experts and a shared expert), byte
                tokens through ``transformers.ByT5Tokenizer``, trained from scratch with
                transformers' ``Trainer`` on the training plays of the embedded Shakespeare
                (``split_by_play``: whole plays are held out) and saved with its tokenizer
                under ``--work`` (git-ignored; the weights are not committed).
2. unit weights ``apply_latent_attention(model, qk_norm="rms")``: the norm at unit weights.
3. calibrated   ``warm_start_qk_norm`` on training-play tokens.
4. fine-tuned   ``Trainer`` on the training plays, evaluated every ``--ft-eval-every`` steps,
                stopped at the first evaluation within ``--target`` (1%) of the source's
                validation loss, or at ``--ft-max-steps``; once from the calibrated model at
                each of ``--ft-lrs``, and the one within the target in the fewest steps kept.
5. reloaded     ``save_pretrained`` + tokenizer, ``qkmla.integrations.transformers.from_pretrained``: the reloaded
                model's loss is compared with the in-memory one, greedy samples are generated
                through the latent cache (and checked against generation without a cache),
                and ``qkmla generate --hf DIR --prompt "ROMEO:" --tokens 80`` runs as a
                subprocess.
6. control      plain MLA (the source, no norm) fine-tuned for the same steps with the same
                settings and batches: what the fine-tune budget alone does to the loss.

Every validation loss is the mean next-token loss (nats per byte) over the same fixed windows
of the validation plays (Twelfth Night, Julius Caesar), evenly spaced.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import ROOT, byte_plays, check_counts, start_recipe

# The model. vocab_size 384: ByT5's 256 bytes + 3 specials (pad 0, eos 1, unk 2) + its 125
# extra ids, which the text never uses.
SHAPE = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 128,
         "num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
         "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
         "max_position_embeddings": 256}
QUICK_SHAPE = SHAPE | {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
                       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 64}
SPECIAL_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}  # ByT5Tokenizer's
PROMPTS = ("Romeo.\n", "First Citizen.\n", "ROMEO:")
CLI_PROMPT, CLI_TOKENS = "ROMEO:", 80


class Windows(torch.utils.data.Dataset):
    """``length`` training windows of ``block`` tokens at random offsets of ``ids`` (the offset of
    window i is fixed by ``seed`` and i, so a run is repeatable), as {"input_ids", "labels"}."""

    def __init__(self, ids: torch.Tensor, block: int, length: int, seed: int):
        self.ids, self.block, self.length, self.seed = ids, block, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, self.ids.numel() - self.block, (1,), generator=g))
        window = self.ids[start:start + self.block]
        return {"input_ids": window, "labels": window}


class Fixed(torch.utils.data.Dataset):
    """Fixed rows [N, T] as {"input_ids", "labels"} (the validation windows, for ``Trainer``)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def spaced_windows(ids: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """``count`` windows of ``block`` tokens evenly spaced over ``ids``: [count, block]."""
    starts = torch.linspace(0, ids.numel() - block, count).long()
    return torch.stack([ids[s:s + block] for s in starts.tolist()])


def val_loss(model, rows: torch.Tensor, batch: int) -> float:
    """Mean next-token loss over ``rows`` [N, T] (every row has T - 1 predictions, so the mean of
    the rows' losses is the mean over tokens)."""
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for chunk in rows.split(batch):
            total += float(model(input_ids=chunk, labels=chunk, use_cache=False).loss) * chunk.shape[0]
    model.train(was_training)
    return total / rows.shape[0]


def training_args(out_dir: Path, *, steps: int, batch: int, lr: float, warmup: int, schedule: str, seed: int,
                  eval_every: int = 0, eval_batch: int = 8, log_every: int = 25, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=batch,
        per_device_eval_batch_size=eval_batch, learning_rate=lr, warmup_steps=warmup, lr_scheduler_type=schedule,
        weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=log_every,
        eval_strategy="steps" if eval_every else "no", eval_steps=eval_every or None, save_strategy="no",
        report_to="none", use_cpu=True, dataloader_num_workers=0, seed=seed, data_seed=seed, disable_tqdm=True,
        remove_unused_columns=False, **extra)


def train_losses(state) -> list:
    return [{"step": e["step"], "loss": round(e["loss"], 4)} for e in state.log_history if "loss" in e]


def fine_tune(model, args, train_data, eval_rows: torch.Tensor, target: float, stop: bool) -> dict:
    """``Trainer`` on ``train_data``, evaluated on ``eval_rows`` every ``args.eval_steps`` steps,
    stopped at the first evaluation at or below ``target`` when ``stop``."""
    from transformers import Trainer, TrainerCallback

    evals = []

    class StopWithin(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            evals.append({"step": state.global_step, "tokens": state.global_step * train_tokens_per_step,
                          "val_loss": metrics["eval_loss"]})
            if stop and metrics["eval_loss"] <= target:
                control.should_training_stop = True

    train_tokens_per_step = args.per_device_train_batch_size * train_data.block
    trainer = Trainer(model=model, args=args, train_dataset=train_data, eval_dataset=Fixed(eval_rows),
                      callbacks=[StopWithin()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    reached = next((e for e in evals if e["val_loss"] <= target), None)
    return {"evals": evals, "train_loss": train_losses(trainer.state), "steps": trainer.state.global_step,
            "within_target_at_step": reached["step"] if reached else None,
            "within_target_at_tokens": reached["tokens"] if reached else None, "wall_s": round(wall, 1)}


def greedy_samples(model, tokenizer, prompts, tokens: int) -> list:
    """Greedy continuations through the latent cache ``generate`` uses, each checked against
    greedy decoding that recomputes the whole sequence at every step (no cache)."""
    from qkmla.integrations.transformers.cache import LatentCacheLayer

    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
            seq = ids
            for _ in range(gen.sequences.shape[1] - ids.shape[1]):
                nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        layers = gen.past_key_values.layers  # generate's DynamicCache, its layers adopted as latent layers
        out.append({"prompt": prompt, "text": tokenizer.decode(gen.sequences[0], skip_special_tokens=True),
                    "new_tokens": gen.sequences.shape[1] - ids.shape[1],
                    "cache": f"{type(gen.past_key_values).__name__} of {type(layers[0]).__name__}",
                    "latent_cache": all(isinstance(layer, LatentCacheLayer) for layer in layers),
                    "cache_bytes_per_token": sum(layer.bytes_per_token for layer in layers)
                    if all(isinstance(layer, LatentCacheLayer) for layer in layers) else None,
                    "same_tokens_without_cache": bool(torch.equal(seq, gen.sequences))})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "hf_qknorm_recipe",
                   help="where the checkpoints go (source/, qknorm/; not committed)")
    p.add_argument("--out", type=Path, default=None, help="the results JSON (default: printed)")
    p.add_argument("--overwrite", action="store_true", help="replace --out and this script's directories in --work")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's); 1 on a shared machine")
    p.add_argument("--quick", action="store_true", help="a tiny model and a few steps (seconds): a smoke test")
    p.add_argument("--block", type=int, default=256, help="tokens per training and validation window")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--source-steps", type=int, default=400)
    p.add_argument("--source-lr", type=float, default=3e-3)
    p.add_argument("--ft-lrs", type=float, nargs="+", default=[3e-4, 5e-4, 1e-3, 2e-3],
                   help="fine-tune learning rates, each from the calibrated model; the one within the target in "
                        "the fewest steps is kept (ties: the lower loss there)")
    p.add_argument("--ft-max-steps", type=int, default=400)
    p.add_argument("--ft-eval-every", type=int, default=10)
    p.add_argument("--target", type=float, default=0.01, help="fine-tune until val loss <= (1 + TARGET) x source's")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--calibration-windows", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=160)
    p.add_argument("--no-control", action="store_true", help="skip the plain-MLA fine-tune")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.block, args.batch, args.source_steps, args.ft_max_steps, args.ft_eval_every = 64, 4, 30, 6, 2
        args.val_windows, args.calibration_windows, args.sample_tokens = 4, 2, 16
    check_counts(p, args, ("block", "batch", "source_steps", "ft_max_steps", "ft_eval_every", "val_windows",
                           "calibration_windows", "sample_tokens"))
    if min(args.ft_lrs) <= 0:
        p.error(f"--ft-lrs: expected positive learning rates, got {args.ft_lrs}")
    if args.target < 0:
        p.error(f"--target: expected a fraction >= 0, got {args.target}")
    shape = dict(QUICK_SHAPE if args.quick else SHAPE)
    if args.sample_tokens + max(map(len, PROMPTS)) > shape["max_position_embeddings"]:
        p.error(f"--sample-tokens: the prompts and {args.sample_tokens} tokens pass max_position_embeddings="
                f"{shape['max_position_embeddings']}")
    if args.block > shape["max_position_embeddings"]:
        p.error(f"--block: at most max_position_embeddings={shape['max_position_embeddings']}, got {args.block}")
    dirs = {name: args.work / name for name in ("source", "qknorm", "trainer")}
    result, write = start_recipe(p, args, __spec__.name, argv, dirs.values())

    from transformers import ByT5Tokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, Trainer

    from qkmla.integrations.transformers import apply_latent_attention, from_pretrained
    from qkmla.convert import warm_start_qk_norm
    from qkmla.train.data import VALIDATION_PLAYS

    # Data: byte tokens of the training plays and the validation plays.
    tokenizer = ByT5Tokenizer()
    train_ids, val_ids = byte_plays(tokenizer)
    val_rows = spaced_windows(val_ids, args.block, args.val_windows)
    g = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, train_ids.numel() - args.block, (args.calibration_windows,), generator=g).tolist()
    calibration_rows = torch.stack([train_ids[s:s + args.block] for s in starts])
    result["data"] = {"corpus": "shakespeare (embedded), split by play", "tokenizer": "transformers.ByT5Tokenizer",
                      "train_tokens": train_ids.numel(), "val_plays": list(VALIDATION_PLAYS),
                      "val_play_tokens": val_ids.numel(), "val_windows": list(val_rows.shape),
                      "calibration_windows": list(calibration_rows.shape),
                      "calibration_source": "training plays, random windows"}
    eval_batch = min(8, args.val_windows)

    # 1. The source model, trained from scratch.
    config = DeepseekV3Config(**shape, **SPECIAL_IDS, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(config)
    result["config"] = shape
    result["params"] = sum(t.numel() for t in model.parameters())
    warmup = max(1, args.source_steps // 20)
    source_args = training_args(dirs["trainer"] / "source", steps=args.source_steps, batch=args.batch,
                                lr=args.source_lr, warmup=warmup, schedule="cosine_with_min_lr", seed=args.seed,
                                lr_scheduler_kwargs={"min_lr_rate": 0.1})
    train_data = Windows(train_ids, args.block, args.source_steps * args.batch, seed=args.seed)
    trainer = Trainer(model=model, args=source_args, train_dataset=train_data)
    t0 = time.perf_counter()
    trainer.train()
    source_wall = time.perf_counter() - t0
    model.save_pretrained(dirs["source"])
    tokenizer.save_pretrained(dirs["source"])
    loss = {"source": val_loss(model, val_rows, eval_batch)}
    result["source_training"] = {
        "steps": args.source_steps, "batch": args.batch, "block": args.block,
        "tokens": args.source_steps * args.batch * args.block, "lr": args.source_lr, "warmup_steps": warmup,
        "schedule": "cosine to 0.1 x lr", "optimizer": "AdamW (0.9, 0.95), weight decay 0.1, clip 1.0",
        "wall_s": round(source_wall, 1), "train_loss": train_losses(trainer.state)}
    result["loss"] = loss
    write()
    del trainer

    # 2. The norm at unit weights, 3. calibrated on training-play tokens.
    apply_latent_attention(model, qk_norm="rms")
    result["params_with_norm"] = sum(t.numel() for t in model.parameters())
    loss["unit_weights"] = val_loss(model, val_rows, eval_batch)
    t0 = time.perf_counter()
    report = warm_start_qk_norm(model, calibration_rows, held_out_ids=val_rows)
    calibration_wall = time.perf_counter() - t0
    loss["calibrated"] = val_loss(model, val_rows, eval_batch)
    result["calibration"] = {"tokens": report["tokens"], "wall_s": round(calibration_wall, 2),
                             "layers": {str(i): layer for i, layer in report["layers"].items()},
                             "warm_start_losses": report["loss"]}
    write()

    # 4. Fine-tuning with Trainer until within the target of the source's loss, at each learning rate.
    target = loss["source"] * (1 + args.target)
    ft_seed = args.seed + 2  # other windows than the source saw
    ft_data = Windows(train_ids, args.block, args.ft_max_steps * args.batch, seed=ft_seed)
    ft_warmup = min(10, args.ft_max_steps)

    def ft_args(name: str, lr: float, steps: int):
        return training_args(dirs["trainer"] / name, steps=steps, batch=args.batch, lr=lr, warmup=ft_warmup,
                             schedule="constant_with_warmup", seed=ft_seed, eval_every=args.ft_eval_every,
                             eval_batch=eval_batch, log_every=args.ft_eval_every)

    calibrated = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for lr in args.ft_lrs:
        model.load_state_dict(calibrated)
        run = fine_tune(model, ft_args(f"qknorm-{lr:g}", lr, args.ft_max_steps), ft_data, val_rows, target, stop=True)
        run.update(lr=lr, tokens=run["steps"] * args.batch * args.block,
                   reached=run["within_target_at_step"] is not None, final_val_loss=run["evals"][-1]["val_loss"])
        runs.append((run, {k: v.clone() for k, v in model.state_dict().items()}))
    ft, state = min(runs, key=lambda r: (not r[0]["reached"], r[0]["steps"], r[0]["final_val_loss"]))
    model.load_state_dict(state)
    loss["fine_tuned"] = val_loss(model, val_rows, eval_batch)
    result["fine_tune"] = {
        **ft, "kept": "the learning rate within the target in the fewest steps (ties: the lower loss there)",
        "warmup_steps": ft_warmup, "schedule": "constant after warmup", "max_steps": args.ft_max_steps,
        "target": f"val loss <= (1 + {args.target}) x source", "target_loss": target,
        "lrs_tried": [{k: r[k] for k in ("lr", "steps", "reached", "final_val_loss", "wall_s")} | {
            "evals": [[e["step"], round(e["val_loss"], 4)] for e in r["evals"]]} for r, _ in runs]}
    ft = result["fine_tune"]
    del runs, calibrated, state
    write()

    # 5. Saved, reloaded with qkmla.integrations.transformers.from_pretrained, generated from through the latent cache.
    model.save_pretrained(dirs["qknorm"])
    tokenizer.save_pretrained(dirs["qknorm"])
    del model
    reloaded = from_pretrained(dirs["qknorm"])
    loss["reloaded"] = val_loss(reloaded, val_rows, eval_batch)
    t0 = time.perf_counter()
    result["samples"] = greedy_samples(reloaded, tokenizer, PROMPTS, args.sample_tokens)
    result["samples_wall_s"] = round(time.perf_counter() - t0, 1)
    ids = torch.tensor([tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]])
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        sampled = reloaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                    temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=shape["max_position_embeddings"] - ids.shape[1],
                                    pad_token_id=tokenizer.pad_token_id)
    result["sampled"] = {"prompt": PROMPTS[0], "temperature": 0.8, "seed": args.seed,
                         "text": tokenizer.decode(sampled[0], skip_special_tokens=True)}
    cli = [sys.executable, "-m", "qkmla", "generate", "--hf", str(dirs["qknorm"]), "--prompt", CLI_PROMPT,
           "--tokens", str(min(CLI_TOKENS, shape["max_position_embeddings"] - 16))]
    if args.threads:
        cli += ["--threads", str(args.threads)]
    proc = subprocess.run(cli, check=False, capture_output=True, text=True, cwd=ROOT)
    shown = ["qkmla", *cli[3:]]
    shown[shown.index(str(dirs["qknorm"]))] = "WORK/qknorm"
    result["cli_generate"] = {"command": " ".join(map(shlex.quote, shown)), "returncode": proc.returncode,
                              "stdout": proc.stdout, "stderr_tail": proc.stderr[-2000:] if proc.returncode else ""}
    del reloaded
    write()

    # 6. The control: plain MLA fine-tuned for the same steps, with the same settings and batches.
    if args.no_control:
        result["control_plain_mla"] = "skipped (--no-control)"
    else:
        plain = apply_latent_attention(DeepseekV3ForCausalLM.from_pretrained(dirs["source"]))
        loss["source_reloaded_plain_mla"] = val_loss(plain, val_rows, eval_batch)
        control = fine_tune(plain, ft_args("control", ft["lr"], ft["steps"]), ft_data, val_rows, target, stop=False)
        loss["control_plain_mla_fine_tuned"] = val_loss(plain, val_rows, eval_batch)
        control.update(note="the source without a norm, fine-tuned for the kept fine-tune's steps (same lr, "
                            "schedule, batches, evaluations)", lr=ft["lr"],
                       tokens=control["steps"] * args.batch * args.block)
        result["control_plain_mla"] = control
        del plain

    result["loss"] = {k: round(v, 6) for k, v in loss.items()}
    result["summary"] = {
        "source": round(loss["source"], 4), "unit_weights": round(loss["unit_weights"], 4),
        "calibrated": round(loss["calibrated"], 4), "fine_tuned": round(loss["fine_tuned"], 4),
        "target": round(target, 4), "within_target": ft["within_target_at_step"] is not None,
        "fine_tune_lr": ft["lr"], "fine_tune_steps": ft["steps"], "fine_tune_tokens": ft["tokens"],
        "reloaded_equals_in_memory": abs(loss["reloaded"] - loss["fine_tuned"]) <= 1e-6 * loss["fine_tuned"],
        "control_plain_mla_fine_tuned": None if args.no_control else round(loss["control_plain_mla_fine_tuned"], 4)}
    result["status"] = "done"
    shutil.rmtree(dirs["trainer"], ignore_errors=True)  # Trainer's output dirs (nothing saved there)
    write()
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
