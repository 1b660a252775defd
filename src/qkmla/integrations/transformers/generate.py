"""Text from a transformers DeepSeek-V2/V3 checkpoint directory, decoded through the latent cache
(what ``qkmla generate --hf DIR`` runs).

The directory is read as transformers reads it (``config.json``, safetensors weights, the
tokenizer files), offline. Its config is checked first, so another architecture is refused
before any weight is read; prompts are left-padded into one batch, as transformers batches
them, and ``generate`` runs after ``apply_latent_attention``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ...cache.eviction import EvictionPolicy, check_kept_fraction
from ...model.generate import check_sampling
from .cache import check_cache_settings
from .model import apply_latent_attention
from ..hub.checkpoint import check_layers_present, check_routing, load_tokenizer, read_hf_config, transformers_config
from ...utils.files import input_file_problem
from .load import _MODEL_TYPES, from_pretrained
from ...utils.checked import as_int, check_seed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_hf_dir(hf_dir, dtype: str = "float32"):
    """(model in eval mode, patched by qkmla with the QK norm it records; tokenizer) from a
    checkpoint directory, both offline."""
    root = Path(hf_dir)
    problem = input_file_problem(root / "config.json")
    if root.is_file():  # config.json itself, or a weights file, was said to have "no config.json"
        raise ValueError(f"hf_dir: {root} is a file; expected a transformers checkpoint directory (the one that holds "
                         f"config.json)")
    if problem == "does not exist":
        raise ValueError(f"hf_dir: {root} has no config.json (expected a transformers checkpoint directory)")
    if problem is not None:  # a FIFO (read forever), a directory, a link to nothing: said as what it is
        raise ValueError(f"hf_dir: {root / 'config.json'} {problem} (expected a transformers checkpoint directory)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {dtype!r}")
    try:  # parsed and its fields checked as every command reads it (a junk field was a traceback)
        hf_config = read_hf_config(root)
    except OSError as e:
        raise ValueError(f"hf_dir: {root / 'config.json'} cannot be read: {e}") from None
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise ValueError(f"hf_dir: {root / 'config.json'} names no model_type, so it is not a transformers "
                         "checkpoint (a qkmla training run is generated from as the run argument, without --hf)")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"hf_dir: {root} holds a {model_type!r} model; qkmla serves {_MODEL_TYPES}")
    check_layers_present(root, hf_config)
    check_routing(transformers_config(root), root / "config.json")  # its first forward failed in topk: a bug
    try:
        tokenizer = load_tokenizer(root)
    except (OSError, ValueError, ImportError) as e:  # no tokenizer files (old transformers: ImportError)
        raise ValueError(f"hf_dir: {root} has no tokenizer transformers can load ({str(e).splitlines()[0]})") from None
    except Exception:  # the tokenizer's load reads config.json: a hand edit transformers refuses is the file's
        transformers_config(root)  # one line naming it (huggingface_hub's validation errors are no ValueError)
        raise
    try:
        model = from_pretrained(root, dtype=DTYPES[dtype], local_files_only=True)
    except ValueError as e:
        if str(e).startswith("hf_dir: "):  # qkmla's loader's own refusal, already naming the directory
            raise
        raise ValueError(f"hf_dir: {root} does not load as its config describes it: {str(e).strip()[:500]}") from None
    except (OSError, RuntimeError) as e:  # missing files, or tensors that disagree with the config
        raise ValueError(f"hf_dir: {root} does not load as its config describes it: {str(e).strip()[:500]}") from None
    return model.eval(), tokenizer


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids as a continuation starts from them: the tokenizer's beginning-of-text
    token if it adds one, never the end-of-sequence token T5-style tokenizers append (the model
    would continue after an end of text)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    default = tokenizer(prompt)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and default[:1] == [bos] and ids[:1] != [bos]:
        ids = [bos] + ids
    if not ids:  # an empty prompt: whatever the tokenizer marks an empty text with
        ids = default
    if not ids:
        raise ValueError(f"prompts: {prompt!r} has no tokens and this tokenizer adds none; give a non-empty prompt")
    return ids


def generate_hf(hf_dir, prompts: Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                top_k: Optional[int] = None, seed: int = 0, kv_format: str = "dense",
                policy: Optional[EvictionPolicy] = None, dtype: str = "float32",
                option: Callable[[str], str] = lambda name: name) -> list[str]:
    """Each prompt followed by its continuation (temperature 0: greedy). ``option`` names the
    policy's arguments in a refusal (``qkmla generate --hf`` passes its flags)."""
    import transformers

    max_new_tokens, temperature, top_k = check_sampling(max_new_tokens, temperature, top_k)
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    # Before the model is loaded. A str is a sequence of one-character prompts: generate_hf(dir, "abc")
    # continued "a", "b" and "c" as three prompts, without a word; a non-str prompt failed in the tokenizer.
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts: expected a list of strings, one per prompt, got {prompts!r:.80}")
    seed = as_int(seed)  # np.int64(3) from a sweep's array is the seed it holds
    check_seed("seed", seed)
    # kv_format='junk' was refused only after the model loaded; a bf16 --dtype with a repositioning policy too
    check_cache_settings(kv_format, policy, None, DTYPES.get(dtype) if isinstance(dtype, str) else None)
    model, tokenizer = load_hf_dir(hf_dir, dtype)
    apply_latent_attention(model, kv_format=kv_format, policy=policy)
    if tokenizer.pad_token is None:  # left padding is masked out, so any token will do
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is None and len(prompts) > 1:
            raise ValueError("prompts: batching them needs a padding token, and this tokenizer has no pad, eos or unk "
                             "token; give one prompt at a time")
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": [prompt_ids(tokenizer, p) for p in prompts]}, padding=True,
                          return_tensors="pt")
    limit = model.config.max_position_embeddings
    if batch["input_ids"].shape[1] + max_new_tokens > limit:
        raise ValueError(f"max_new_tokens: the longest prompt ({batch['input_ids'].shape[1]} tokens) plus "
                         f"{max_new_tokens} new tokens passes the model's max_position_embeddings={limit}")
    if policy is not None:  # a fraction the sinks and window make impossible: a policy that evicts nothing
        width = batch["input_ids"].shape[1]
        check_kept_fraction(policy, width if policy.interval is None else width + max_new_tokens, option)
    # Exactly what was asked: none of the checkpoint's own sampling defaults (top_p, repetition
    # penalty, ...) applies; its end-of-sequence token does.
    generation = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
        top_k=top_k or 0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id, bos_token_id=model.generation_config.bos_token_id)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(**batch, generation_config=generation)
    new = out[:, batch["input_ids"].shape[1]:]
    return [p + tokenizer.decode(t, skip_special_tokens=True) for p, t in zip(prompts, new)]
