"""``qkmla convert``: a whole transformers DeepSeek-V2/V3 checkpoint directory, given a QK norm
and calibrated on real text, written as a new checkpoint directory.

    convert_checkpoint("DeepSeek-V2-Lite", "V2-Lite-qknorm", qk_norm="rms")

Every tensor of the source is kept as it is stored (its shards are copied, or cast to ``dtype``, one
at a time); the norm weights are added, as a shard of their own, and calibrated as
:func:`~qkmla.convert.calibrate.warm_start_qk_norm` calibrates a whole model, on the first
``calibration_tokens`` tokens of a text (by default the embedded Shakespeare, through the
checkpoint's own tokenizer), and the next-token loss is measured on the tokens after them,
before and after. The calibration loads one decoder layer at a time (``stream``), so converting
needs about one shard or one layer of memory, not the model's. The config records the norm (qkmla's
model type and architecture); the tokenizer, generation config and every other file are copied, so
``qkmla generate --hf OUT`` and ``qkmla.integrations.transformers.from_pretrained(OUT)`` read the result.

The output directory is never the source (nor inside it), is written under a temporary name
and renamed when complete, and replaces an existing directory only with ``overwrite``.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from ..config import QKNormConfig
from ..utils.files import clear_stale, directory_state, make_directory, output_directory, write_directory
from ..integrations.hub.checkpoint import CONFIG, check_utf8_path, load_tokenizer, read_hf_config, transformers_config
from ..integrations.hub.output import check_checkpoint_out
from ..utils.checked import as_int, check_bool, is_int

DEFAULT_CALIBRATION_TOKENS = 4096
HELD_OUT_TOKENS = 4096
ROW = 512  # calibration tokens per row (fewer when the model's context is shorter)


def lock_file(out: Path) -> Path:
    """The lock a conversion into the directory ``out`` holds (:func:`converting_into`): ``OUT.lock``
    beside it. ``out`` is the directory written (:func:`~qkmla.utils.files.output_directory`), so two
    conversions through two links to one directory exclude each other."""
    return out.with_name(out.name + ".lock")


def check_dtype(dtype) -> None:
    """A ValueError naming ``dtype`` unless it is None or a floating-point torch.dtype: a str ("bfloat16") was
    taken, and the conversion failed as it read the weights with "Invalid device string: 'bfloat16'"."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype: expected None (the stored dtype) or a floating-point torch.dtype "
                         f"(e.g. torch.bfloat16), got {dtype!r}")


def check_convert_paths(src: Union[str, Path], out: Union[str, Path], overwrite: bool,
                        inputs: Iterable = (), target: Optional[Path] = None) -> tuple[Path, Path]:
    """(src, out) if ``out`` can take a conversion of ``src``: not ``src`` or inside it, not a file,
    not an existing non-empty directory unless ``overwrite``, holding none of the other files the
    conversion reads (``inputs``: (option, path) pairs, the calibration text). ValueError naming
    ``src`` / ``out`` (the commands' --hf / --out).
    First, what a conversion into ``out`` killed outright left is swept (``clear_stale``: its
    temporary removed, an ``out`` it had moved aside put back; its lock file), so ``out`` is checked
    as it really is. ``target``: the directory written for ``out`` (a link of the user's own is
    followed: :func:`~qkmla.utils.files.output_directory`), resolved by the caller that writes it."""
    from ..train.rundir import remove_stale_lock

    # First: overwrite="no" is truthy, and replaced an existing checkpoint unasked (and clear_stale below
    # is work an unchecked call must not do)
    check_bool("overwrite", overwrite)
    src, out = Path(src), Path(out)
    for name, path in (("src", src), ("out", out)):
        # a name that is not UTF-8 failed mid-conversion, after the model was loaded and converted
        check_utf8_path(name, path)
    given, out = out, output_directory("out", out) if target is None else target
    clear_stale(out)
    remove_stale_lock(lock_file(out))
    if not src.is_dir():
        raise ValueError(f"src: {src} is not a directory (expected a transformers checkpoint directory)")
    read_hf_config(src, "src")
    check_checkpoint_out(out, given, src, overwrite, inputs)
    return src, given


@contextmanager
def converting_into(src: Path, out: Path, overwrite: bool):
    """``with converting_into(src, out, overwrite) as (target, state):`` this process alone converts into
    ``target``, the directory written for ``out`` (:func:`~qkmla.utils.files.output_directory`; an
    ``flock`` on ``OUT.lock`` beside it, released by the kernel however the process ends), or a
    ValueError naming --out and the holder: a second conversion into the same ``out`` would
    otherwise replace the first one's output unasked. ``out`` is checked again once held (another
    conversion may have finished into it since). Yields (target, its state then): the write passes the
    state on (``write_directory(target, write, state)``), so an ``out`` another command writes while
    this one converts (``qkmla train --out`` the same name: its lock is not this one) is not replaced."""
    from ..train.rundir import RunLock

    target = output_directory("out", out)  # resolved once: the lock, the checks and the write agree on it
    make_directory("out", target.parent)
    with RunLock(target, lock=lock_file(target)):
        check_convert_paths(src, out, overwrite, target=target)
        yield target, directory_state(target)


def calibration_batches(tokenizer, text: str, calibration_tokens: int, context: int) -> tuple:
    """(calibration ids [B, T], held-out ids [B', T']): the first ``calibration_tokens`` tokens of
    ``text`` and up to HELD_OUT_TOKENS after them, in rows of min(ROW, context) tokens."""
    row = min(ROW, context, calibration_tokens)
    needed = calibration_tokens + max(HELD_OUT_TOKENS, 2 * row)
    chars = 8 * needed  # a prefix long enough for the tokens used, longer until it is: not the whole text's ids
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > needed + 64 or chars >= len(text):  # the cut changes at most its last words
            break
        chars *= 2
    ids = torch.tensor(ids, dtype=torch.long)
    if ids.numel() == 0:  # the text is at fault (an empty file), not the count asked of it
        raise ValueError("calibration_text: the calibration text gives 0 tokens (an empty file?); give text like "
                         "the model's data")
    if ids.numel() < calibration_tokens + 2 * row:
        raise ValueError(f"calibration_tokens: the calibration text has {ids.numel()} tokens, too few for "
                         f"{calibration_tokens} calibration tokens and two held-out rows of {row}")
    cal = ids[:calibration_tokens // row * row].view(-1, row)
    rest = ids[cal.numel():cal.numel() + HELD_OUT_TOKENS]
    return cal, rest[:rest.numel() // row * row].view(-1, row)


def write_checkpoint(model, tokenizer, out: Path, state: Optional[tuple]) -> None:
    """``model.save_pretrained`` (and the tokenizer's, if any) into ``out``, as
    :func:`~qkmla.utils.files.write_directory` writes: whole or not at all, and only over the ``out``
    whose :func:`~qkmla.utils.files.directory_state` was ``state`` (given by :func:`converting_into`)."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    write_directory(out, write, state)


def convert_checkpoint(src: Union[str, Path], out: Union[str, Path], *,
                       qk_norm: Union[None, str, QKNormConfig] = "rms",
                       calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS, calibration_text: Optional[str] = None,
                       dtype: Optional[torch.dtype] = None, overwrite: bool = False, inputs: Iterable = ()) -> dict:
    """Write ``src`` with a QK norm, calibrated, to ``out`` (see the module docstring).

    Args:
        qk_norm: the norm to add, a :class:`~qkmla.QKNormConfig` or its shorthand ("rms", "l2", "lp");
            None re-saves the model as it is.
        calibration_tokens: tokens of the calibration batch; 0 leaves the norm weights at ones.
        calibration_text: the text to calibrate on; None reads the embedded Shakespeare.
        dtype: the written dtype (and the calibration's); None keeps the stored one. Refused for a
            quantized checkpoint.
        inputs: (option, path) of the files the caller read for this conversion (the command's
            --calibration-text): an ``out`` holding one is refused, as ``overwrite`` would destroy it.

    Returns:
        the calibration report (:func:`~qkmla.convert.calibrate.warm_start_qk_norm`), {} without one.

    Raises:
        ValueError, before the weights are read: the paths (:func:`check_convert_paths`), the norm,
        ``calibration_tokens``, a source without a tokenizer when calibrating, ``dtype`` for a
        quantized source; and naming the layer, a layer whose tensors do not load as the config
        describes them.
    """
    from .stream import CheckpointStream, calibrate_streaming, copy_other_files, write_weights
    from ..integrations.hub.checkpoint import INDEX, check_norm_tensors, saved_norm
    from ..integrations.hub.record import CODE, describe, record_norm, recorded_groups

    src, out = check_convert_paths(src, out, overwrite, inputs)
    norm = QKNormConfig.of(qk_norm)
    check_dtype(dtype)
    calibration_tokens = as_int(calibration_tokens)  # np.int64(64) was refused as "... got np.int64(64)"
    if not is_int(calibration_tokens) or calibration_tokens < 0:
        raise ValueError(f"calibration_tokens: expected an int >= 0, got {calibration_tokens!r}")
    if calibration_tokens and norm is None:
        raise ValueError("calibration_tokens: calibrates a QK norm being added; name the norm too "
                         "(qk_norm, --qk-norm), or pass 0")
    if calibration_text is not None and norm is None:  # the text would be dropped without a word
        raise ValueError("calibration_text: the text a QK norm being added is calibrated on; name the norm too "
                         "(qk_norm, --qk-norm), or leave the text out")
    if calibration_text is not None and norm is not None and not calibration_tokens:
        # 0 tokens leaves the norm weights at ones: the text was read by nothing, without a word
        raise ValueError("calibration_text: the text a QK norm is calibrated on, and calibration_tokens=0 "
                         "(--calibration-tokens 0) calibrates on none of it (the norm weights stay at ones); give more "
                         "calibration_tokens (--calibration-tokens, at least 16), or leave the text out")
    if calibration_tokens and calibration_tokens < 16:
        raise ValueError(f"calibration_tokens: expected 0 (no calibration) or at least 16, got {calibration_tokens}")
    # named as src, as this function's other refusals: a record that is not valid was refused naming the file alone,
    # and its num_kv_groups (2.0, or 3 of 4 heads) as "model.config", which the caller never named
    existing = saved_norm(src, "src")
    recorded_groups(read_hf_config(src, "src"), f"src: {src / CONFIG}")
    if existing is not None and norm is not None:
        raise ValueError(f"qk_norm: {src / CONFIG} already records the QK norm {describe(existing)}, with trained "
                         f"weights that adding and calibrating a norm would replace; leave qk_norm out to re-save it")
    from ..integrations.transformers import auto  # noqa: F401  (qkmla's model types, for AutoConfig)

    transformers_config(src, "src")  # first: the tokenizer's load reads config.json too, and a hand edit failed there
    try:
        tokenizer = load_tokenizer(src)
    except (OSError, ValueError, ImportError) as e:  # no tokenizer files (old transformers: ImportError)
        if calibration_tokens:
            raise ValueError(f"src: {src} has no tokenizer transformers can load, which calibration needs "
                             f"({str(e).splitlines()[0]}); pass calibration_tokens=0 (--calibration-tokens 0) to "
                             f"keep the norm weights at ones") from None
        tokenizer = None
    if calibration_text is None and calibration_tokens:
        from ..train.data import load_text

        calibration_text = load_text("shakespeare")
    hf_config = read_hf_config(src, "src")
    context = hf_config.get("max_position_embeddings") or ROW
    batches = calibration_batches(tokenizer, calibration_text, calibration_tokens, context) \
        if calibration_tokens else None
    vocab = hf_config.get("vocab_size")
    top = int(max(b.max() for b in batches)) if batches is not None else -1
    if isinstance(vocab, int) and top >= vocab:
        raise ValueError(f"src: {src}'s tokenizer gives token ids up to {top}, beyond the model's vocab_size {vocab}; "
                         f"the tokenizer is not this model's")

    if dtype is not None and hf_config.get("quantization_config") is not None:
        raise ValueError(f"dtype: {src / CONFIG} records a quantization_config ("
                         f"{hf_config['quantization_config'].get('quant_method', '?')}); casting quantized weights "
                         f"would need dequantizing them: leave dtype (--dtype) out")

    with converting_into(src, out, overwrite) as (target, state):
        try:  # the stream names the directory as the loaders do, hf_dir: this function's argument is src
            if existing is not None:  # a re-save: its norm weights as the loaders check them (a NaN one was copied)
                check_norm_tensors(src, hf_config, existing)
            stream = CheckpointStream(src, dtype)
            if norm is not None:
                report, norm_tensors = calibrate_streaming(stream, norm, *(batches or (None, None)))
            else:
                report, norm_tensors = {}, {}
        except ValueError as e:
            if not str(e).startswith("hf_dir: "):
                raise
            raise ValueError("src: " + str(e)[len("hf_dir: "):]) from None
        config = stream.config
        if dtype is not None:
            config.dtype = dtype
        if norm is not None or existing is not None:  # a re-save records its norm again: AutoConfig reads the
            record_norm(config, norm or existing)      # attn_implementation guard into a field it does not write

        def write(tmp: Path) -> None:
            copy_other_files(src, tmp, skip={CONFIG, INDEX, f"{CODE}.py"})
            write_weights(stream, tmp, norm_tensors, dtype)
            config.save_pretrained(tmp)  # config.json (and, with a norm, the code its auto_map names)

        write_directory(target, write, state)
    return report
