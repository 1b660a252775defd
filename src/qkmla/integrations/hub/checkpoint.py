"""Whole Hugging Face DeepSeek-V2/V3 checkpoint directories: one :class:`~qkmla.MLA` per layer.

A checkpoint directory holds ``config.json`` and the weights, either sharded
(``model.safetensors.index.json`` maps every tensor name to its shard file) or in one
``model.safetensors``. Layer i's attention weights are ``model.layers.{i}.self_attn.<name>``
with MLA's own parameter names.

Only the attention tensors of the chosen layers are read: each shard that holds one is opened
with safetensors' lazy ``safe_open`` (a header read and a memory map), and each tensor is
read on its own, so a 671B-parameter model's attention layers load without its experts.
Everything that can be checked before reading a tensor is: the config, the layer indices,
every needed name in the index, the presence of every needed shard, and every shape (from
the shard headers).

Block-quantized FP8 weights (DeepSeek-V3's release: ``float8_e4m3fn`` with a
``weight_scale_inv`` per 128 x 128 block) are dequantized to bfloat16, as transformers does.

A checkpoint qkmla saved records its QK norm (and a GQA conversion's KV groups) in config.json's
``"qkmla"`` entry (:mod:`qkmla.integrations.hub.record`): its layers are built with that norm and
its weights (``self_attn.q_norm.*``, ``k_norm.*``, ``logit_scale``), and G groups with one copy
of each group's ``kv_b_proj`` rows; a record and norm tensors that disagree are refused, as
``qkmla.integrations.transformers.from_pretrained`` refuses them.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import os
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from ...attention.mla import MLA
from ...config import MLAConfig, QKNormConfig
from ...norms import qk_norms_of
from ...utils.checked import as_int, is_finite_number, is_int
from ...utils.devices import check_device
from ...utils.files import check_path, input_file_problem
from .config import _OURS, check_dense, mla_config_from_hf, unrepeat_groups
from .record import GROUPS, RECORD, describe, recorded_groups, recorded_norm

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_FP8 = ("F8_E4M3", "F8_E5M2")


# MLAConfig fields that size an attention layer's weights (an override of one can contradict the checkpoint)
_SHAPE_FIELDS = ("hidden_size", "num_heads", "num_kv_groups", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "attention_bias")


def attention_prefix(layer: int) -> str:
    """The tensor-name prefix of layer ``layer``'s attention in an HF DeepSeek checkpoint."""
    return f"model.layers.{layer}.self_attn."


def check_utf8_path(name: str, path: Union[str, Path]) -> None:
    """A ValueError naming ``name`` for a path that is not UTF-8 (a surrogate escape in Python): safetensors
    and tokenizers (Rust) take paths as UTF-8 strings, and failed on one after the config was read, as
    'not a readable safetensors file' of a file that was fine. Every reader and writer of a checkpoint
    directory checks its paths here. The path is checked as given, the string those libraries get: a
    relative name under a working directory that is not UTF-8 opens fine."""
    try:
        str(Path(path)).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name}: {path} is not a UTF-8 path, which safetensors and tokenizers cannot open; "
                         "rename it (or a directory above it)") from None


def check_path_type(hf_dir, what: str) -> None:
    """A TypeError naming ``hf_dir`` for what is not a str or a path (None, 5, bytes): ``Path()``'s own said only
    "expected str, bytes or os.PathLike object, not NoneType", naming no argument."""
    if not isinstance(hf_dir, (str, os.PathLike)):
        raise TypeError(f"hf_dir: expected {what} (a str or a path), got {hf_dir!r:.80}")


def checkpoint_dir(name_or_path: Union[str, Path], *, revision: Optional[str] = None,
                   cache_dir: Union[None, str, Path] = None, subfolder: str = "", local_files_only: bool = False,
                   token: Union[None, bool, str] = None, force_download: bool = False) -> Path:
    """The checkpoint directory ``name_or_path`` names, on this machine.

    A directory is itself (``subfolder`` inside it). Anything else is read as a Hugging Face hub
    repository id: its JSON files (config.json, the safetensors index, ...) and safetensors weights at
    ``revision`` (a branch, tag or commit hash; None: the default branch) are fetched into the hub
    cache (``cache_dir``, else ``HF_HUB_CACHE``) with ``huggingface_hub.snapshot_download``, which
    reads them from the cache alone offline (``HF_HUB_OFFLINE=1`` or ``local_files_only``), and the
    snapshot's directory is returned.

    Raises:
        ValueError: naming ``hf_dir``, for a path that is not a directory and not a repository id, or a
            repository (or revision) that cannot be fetched, or is not in the cache offline.
    """
    # Path("") is "." (the working directory, loaded unasked) and an over-long name made is_dir() raise a
    # bare OSError: both refused naming hf_dir, as every other path qkmla takes.
    check_path_type(name_or_path, "a checkpoint directory or a hub repository id")
    root = check_path("hf_dir", name_or_path, "checkpoint directory")
    # revision=123 failed in huggingface_hub's regex ("expected string or bytes-like object, got 'int'")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"revision: expected None (the default branch) or a branch, tag or commit hash, "
                         f"got {revision!r}")
    if not isinstance(subfolder, (str, os.PathLike)):
        raise ValueError(f"subfolder: expected a path inside the checkpoint ('' for none), got {subfolder!r}")
    subfolder = os.fspath(subfolder)
    if root.is_dir():
        found = root / subfolder if subfolder else root
        check_utf8_path("hf_dir", found)
        return found
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(name_or_path))
    except HFValidationError:
        raise ValueError(f"hf_dir: {root} is not a directory (nor a hub repository id)") from None
    patterns = [f"{subfolder.strip('/')}/{p}" if subfolder else p for p in ("*.json", "*.safetensors")]
    try:
        snapshot = snapshot_download(str(name_or_path), revision=revision, cache_dir=cache_dir, token=token,
                                     # offline, a commit hash is looked up in the cache too (huggingface_hub 1.x
                                     # asks the hub for its file list unless told it is offline)
                                     local_files_only=local_files_only or constants.HF_HUB_OFFLINE,
                                     force_download=force_download,
                                     allow_patterns=patterns)
    except (OSError, EntryNotFoundError) as e:  # no such repository or revision, no access, offline and not cached
        raise ValueError(f"hf_dir: {name_or_path} is not a directory, and as a hub repository (revision "
                         f"{revision or 'default'}) it cannot be fetched: {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    return Path(snapshot) / subfolder if subfolder else Path(snapshot)


def read_hf_config(hf_dir: Union[str, Path], name: str = "hf_dir") -> dict:
    """The parsed ``config.json`` of a checkpoint directory.

    Raises:
        ValueError: naming the file (as ``name``, the caller's argument for the directory) when it
            is missing, unreadable, not a JSON object, or holds a field of a type transformers'
            config class refuses.
    """
    path = Path(hf_dir) / CONFIG
    problem = input_file_problem(path)  # a FIFO is read forever: refused with what it is
    if problem is not None:
        raise ValueError(f"{name}: {path} {problem}; a Hugging Face checkpoint directory has a {CONFIG}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: {path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: {path} cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{name}: {path}: expected a JSON object, got {type(config).__name__}")
    _check_values(path, config, name)  # first: transformers' check of a bool count named no field
    _check_fields(path, config, name)
    eps = config.get("rms_norm_eps")
    # transformers takes any number here; a negative one put NaN under every RMSNorm's square root, which
    # convert calibrated on and wrote out, and generate then failed on as an internal error
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                            or eps <= 0):
        raise ValueError(f"{name}: {path}: rms_norm_eps must be a finite number > 0 (every RMSNorm adds it under a "
                         f"square root), got {eps!r}")
    return config


def transformers_config(hf_dir: Union[str, Path], name: str = "hf_dir"):
    """``transformers.AutoConfig`` of a checkpoint directory (local files only), or a ValueError naming
    ``name`` and the file: huggingface_hub's validation errors (``num_hidden_layers`` 3 against one
    ``layer_types``; a yarn ``rope_parameters`` without its factor) are no ValueError, and a
    hand-edited config.json was an internal error, with its traceback, wherever it was read first (the
    tokenizer's load reads it too). A QK-normed checkpoint's model type is known to AutoConfig once
    ``qkmla.integrations.transformers`` is imported, which the callers above this layer do."""
    import transformers

    path = Path(hf_dir) / CONFIG
    try:  # not a FIFO (read forever), a device or a link to nothing: those are transformers' to name below
        fields = json.loads(path.read_text(encoding="utf-8")) if input_file_problem(path) is None else None
    except (OSError, ValueError):  # unreadable, not JSON: transformers' words below name the file
        fields = None
    if isinstance(fields, dict) and not isinstance(fields.get("model_type"), str):
        # transformers' own words ("Unrecognized model in DIR. Should have a `model_type` key ...") came out of
        # `qkmla convert` where `generate --hf` said what is wrong, and what the directory may be instead
        raise ValueError(f"{name}: {path} names no model_type, so it is not a transformers checkpoint (a qkmla "
                         "training run's config.json has none: `qkmla generate RUN` samples from one)")
    try:
        return transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises for the file, named as the file's
        detail = " ".join(x.strip() for x in str(e).splitlines() if x.strip()).rstrip(": ")
        raise ValueError(f"{name}: {Path(hf_dir) / CONFIG} is not a config transformers can read "
                         f"({type(e).__name__}: {detail[:300]})") from None


V2_TOPK_METHODS = ("greedy", "group_limited_greedy")  # transformers' DeepseekV2 router: any other name fails in it


def check_routing(config, path: Path, num_layers: Optional[int] = None, name: str = "hf_dir") -> None:
    """A DeepSeek-V2/V3 ``config`` (``transformers.AutoConfig``, read from ``path``) with MoE layers
    routes each token to ``num_experts_per_tok`` of its ``n_routed_experts``, picking ``topk_group`` of
    ``n_group`` groups where it routes by groups (V3; V2's ``group_limited_greedy``). A hand-edited
    config.json outside that (8 of 4 experts, 3 of 1 group, 4 experts in 3 groups, a V2 ``topk_method``
    its router does not know) sizes no tensor, so
    it loaded and converted without a word, and its first forward failed in torch.topk or a view
    (``generate --hf``: an internal error). ValueError naming ``name`` and ``path`` otherwise."""
    from .record import stock_model_type

    c = config
    layers = c.num_hidden_layers if num_layers is None else num_layers
    if not getattr(c, "n_routed_experts", None) or (getattr(c, "first_k_dense_replace", 0) or 0) >= layers:
        return  # no MoE layer: the router's numbers are read by nothing
    experts, k = c.n_routed_experts, getattr(c, "num_experts_per_tok", None)
    method = getattr(c, "topk_method", None)
    if stock_model_type(c.model_type) == "deepseek_v2" and method not in V2_TOPK_METHODS:  # else picked no expert
        raise ValueError(f"{name}: {path} routes by topk_method={method!r}, which DeepSeek-V2's router does not "
                         f"know; expected one of {V2_TOPK_METHODS}")
    grouped = stock_model_type(c.model_type) == "deepseek_v3" or method == "group_limited_greedy"
    groups, chosen = (getattr(c, "n_group", None), getattr(c, "topk_group", None)) if grouped else (1, 1)
    if not (is_int(experts) and experts >= 1 and is_int(groups) and groups >= 1 and experts % groups == 0):
        raise ValueError(f"{name}: {path} splits n_routed_experts={experts!r} into n_group={groups!r} groups; "
                         "expected a positive int that divides it")
    if not (is_int(chosen) and 1 <= chosen <= groups):
        raise ValueError(f"{name}: {path} routes through topk_group={chosen!r} of its n_group={groups} groups; "
                         "expected an int from 1 to n_group")
    if not (is_int(k) and 1 <= k <= experts):
        raise ValueError(f"{name}: {path} routes each token to num_experts_per_tok={k!r} of its "
                         f"n_routed_experts={experts} experts; expected an int from 1 to n_routed_experts")
    per_group = experts // groups
    if stock_model_type(c.model_type) == "deepseek_v3" and per_group < 2:  # its first forward failed in topk
        raise ValueError(f"{name}: {path} puts {per_group} of its n_routed_experts={experts} experts in each of "
                         f"n_group={groups} groups; DeepSeek-V3's router scores a group by its top 2 experts, so "
                         "a group needs at least 2")
    if k > chosen * per_group:  # the router would pick experts of groups it masked out
        raise ValueError(f"{name}: {path} routes each token to num_experts_per_tok={k} experts from topk_group="
                         f"{chosen} groups of {per_group}, which hold only {chosen * per_group}")


def load_tokenizer(hf_dir: Union[str, Path]):
    """The tokenizer of a checkpoint directory (``AutoTokenizer``, local files only), as every
    command loads it.

    Raises:
        whatever transformers raises for a directory without one (OSError, ValueError, ImportError),
        and ValueError for one it makes without a vocabulary: transformers 5 builds an empty
        Qwen2Tokenizer for a Qwen3 directory that has no tokenizer files, which turns every text into
        no tokens (convert-gqa wrote it into its output as the model's tokenizer; generate called the
        prompt empty, convert-gqa the calibration text).
    """
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    # Judged by its vocabulary, not by encoding a sample text: a vocabulary without Latin letters
    # (and no byte fallback) may encode an English sample to nothing and still be a tokenizer.
    if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
        raise ValueError(f"{hf_dir} holds no usable tokenizer: transformers made an empty {type(tokenizer).__name__} "
                         "(no vocabulary), which turns every text into no tokens")
    return tokenizer


def _check_fields(path: Path, config: dict, name: str = "hf_dir") -> None:
    """transformers' own check of the fields of a model type it knows, made here, where every
    command reads the file first: a field of the wrong type (``"hidden_size": "abc"``, an edit by
    hand) raised huggingface_hub's StrictDataclassFieldValidationError, not a ValueError, from
    whichever load came first (the tokenizer's, the model's), printed as a bug in qkmla. Only a
    field's type is refused here; anything else the config class objects to (a rope type qkmla
    does not serve, a layer type) is left to the loaders, which name it better. Warnings the
    config gives are given here (transformers prints each once per process)."""
    try:
        from huggingface_hub.errors import StrictDataclassFieldValidationError
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:  # no transformers, or an older one: no strict fields to fail on
        return
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return  # no model type, or one transformers does not know: each loader names what it expects
    try:
        CONFIG_MAPPING[model_type].from_dict(dict(config))
    except StrictDataclassFieldValidationError as e:
        detail = " ".join(line.strip() for line in str(e).strip().splitlines()[:2])
        raise ValueError(f"{name}: {path} is not a config transformers can read ({type(e).__name__}: "
                         f"{detail[:300]})") from None
    except Exception:  # noqa: BLE001 - anything else the loaders name better
        pass


# the most decoder layers a config.json may count before its weights are read: more than any model has
# (DeepSeek-V3: 61), and a count transformers builds on the meta device in seconds, where 2**70 hung every loader
MAX_LAYERS = 100_000


def _check_values(path: Path, config: dict, name: str) -> None:
    """The values transformers' config class takes without a word, each named as the config names it:
    ``rope_theta`` 0, True or "abc" (0 read as the default 10000 by ``or``, True as 1, "abc" failed deep in
    the RoPE table), ``dtype`` 5 (an AttributeError from transformers' loader), ``num_hidden_layers`` 0,
    -1 or 2**70 (0 and -1 converted to an empty model, 2**70 hung the loaders counting its layers) and
    ``max_position_embeddings`` -1 (convert's calibration failed in torch)."""
    rope = [config] + [config[k] for k in ("rope_parameters", "rope_scaling") if isinstance(config.get(k), dict)]
    for theta in (r["rope_theta"] for r in rope if r.get("rope_theta") is not None):
        if not is_finite_number(theta) or not theta > 0:
            raise ValueError(f"{name}: {path}: rope_theta must be a finite number > 0 (RoPE's base), got {theta!r}")
    for key in ("dtype", "torch_dtype"):
        dtype = config.get(key)
        if dtype is not None and not (isinstance(dtype, str) and (
                dtype == "auto" or isinstance(getattr(torch, dtype, None), torch.dtype))):
            raise ValueError(f"{name}: {path}: {key} must name a torch dtype (\"bfloat16\", \"float32\", ...), got "
                             f"{dtype!r}")
    layers = config.get("num_hidden_layers")
    if "num_hidden_layers" in config and (not is_int(layers) or not 1 <= layers <= MAX_LAYERS):
        raise ValueError(f"{name}: {path}: num_hidden_layers must be an int from 1 to {MAX_LAYERS}, got {layers!r}")
    # -1 sized convert's calibration rows: torch's "only one dimension can be inferred", an internal error
    context = config.get("max_position_embeddings")
    if context is not None and (not is_int(context) or context < 1):
        raise ValueError(f"{name}: {path}: max_position_embeddings must be a positive int (the longest sequence "
                         f"the model reads), got {context!r}")


def check_layers_present(hf_dir: Union[str, Path], hf_config: dict, name: str = "hf_dir") -> None:
    """Every decoder layer ``num_hidden_layers`` counts has attention weights in the checkpoint's
    listing: transformers builds a layer the weights lack with random weights, and says so only in
    its load report (a config.json edited up from 3 layers to 4 generated from a random fourth).

    Raises:
        ValueError: naming ``name``, the config and the first layer missing.
    """
    root = Path(hf_dir)
    layers = hf_config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool):
        return  # the config's own checks name it
    weight_map, listing = _weight_map(root)
    present = {int(m.group(1)) for k in weight_map if (m := _ATTENTION_KEY.match(k))}
    missing = [i for i in range(layers) if i not in present]
    if missing:
        raise ValueError(f"{name}: {root / CONFIG} describes {layers} layers, and {listing} holds no attention "
                         f"weights for layer {missing[0]} ({len(missing)} of them): the config and the weights are "
                         "not of one model")


_ATTENTION_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.")
# a QK norm's tensor (qkmla's), under self_attn. or LongCat-Flash's self_attn.0. / self_attn.1.
_NORM_KEY = re.compile(r"self_attn\.(?:\d+\.)?(?:q_norm\.|k_norm\.|logit_scale)")
# an MLA attention module's prefix under its layer: self_attn., or LongCat-Flash's self_attn.0. and self_attn.1.
_MLA_MODULE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.(?:\d+\.)?)kv_a_proj_with_mqa\.")


def _weight_map(root: Path) -> tuple[dict[str, str], Path]:
    """(tensor name -> shard file name, the file that says so)."""
    index = root / INDEX
    if index.is_file() and (root / SINGLE).is_file():
        # transformers loads model.safetensors and never reads the index; these checks read the index:
        # a stale or damaged model.safetensors beside it passed them, then failed inside transformers.
        raise ValueError(f"hf_dir: {root} holds both {SINGLE} and {INDEX} (the weights in one file, and "
                         f"an index of shards): transformers loads {SINGLE} alone; remove the one that is stale")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except UnicodeDecodeError as e:  # was a UnicodeDecodeError traceback, naming no file
            raise ValueError(f"hf_dir: {index}: not UTF-8 text ({e.reason} at byte {e.start}); expected a JSON "
                             f"object with a 'weight_map'") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: expected a JSON object with a 'weight_map' ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names, got a "
                             f"{type(weight_map).__name__}")
        bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names; {bad[0]!r} maps "
                             f"to {bad[1]!r}")
        return weight_map, index
    single = root / SINGLE
    if single.is_file():
        with _open(single) as f:
            return {k: SINGLE for k in f.keys()}, single
    raise ValueError(f"hf_dir: {root} has neither {INDEX} nor {SINGLE}")


def _open(path: Path, name: str = "hf_dir"):
    """A safetensors file of the checkpoint directory read (``name``, the caller's argument for it), open; a
    ValueError naming both otherwise (``qkmla convert`` over a cut shard said the path alone, no option)."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{name}: {path}: not a readable safetensors file ({e})") from None


def _check_layers(layers, num_layers: int, config_path: Path) -> list[int]:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{config_path}: num_hidden_layers must be a positive int, got {num_layers!r}")
    if layers is None:
        chosen = list(range(num_layers))
    else:
        try:  # one index or several; layers=1.0 failed in list() with "'float' object is not iterable"
            chosen = [layers] if isinstance(layers, int) else list(layers)
        except TypeError:
            chosen = [layers]
    chosen = [as_int(i) for i in chosen]  # a NumPy index is an index (refused as "got np.int64(1)")
    bad = [i for i in chosen if not is_int(i) or not 0 <= i < num_layers]
    if bad or not chosen:
        raise ValueError(f"layers: expected layer indices in [0, {num_layers}) (num_hidden_layers of "
                         f"{config_path}), got {layers!r}")
    return sorted(set(chosen))


def _dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 weight [out, in] times its per-block scale [ceil(out / b0), ceil(in / b1)] -> bfloat16."""
    b0, b1 = block
    scale = scale_inv.float().repeat_interleave(b0, 0)[:w.shape[0]].repeat_interleave(b1, 1)[:, :w.shape[1]]
    return (w.float() * scale).to(torch.bfloat16)


def mla_layers_from_hf_dir(hf_dir: Union[str, Path], layers: Optional[Union[int, Iterable[int]]] = None, *,
                           dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                           **overrides) -> dict[int, MLA]:
    """One :class:`MLA` per attention layer of an HF DeepSeek-V2/V3 checkpoint directory.

    Args:
        hf_dir: the directory (config.json and safetensors weights, sharded or not).
        layers: None for every layer, a layer index, or several.
        dtype: the modules' dtype; None keeps the stored one (bfloat16 for FP8 weights).
        device: where the modules live.
        overrides: MLAConfig fields, e.g. ``qk_norm="rms"`` to start QK-norm training on a plain
            checkpoint (norm weights start at ones; for a whole model, ``apply_latent_attention(model,
            qk_norm="rms")`` and :func:`qkmla.convert.warm_start_qk_norm` calibrate them). A
            checkpoint that records a norm loads with it and its weights (module docstring).

    Returns:
        {layer index: MLA}, in layer order.

    Raises:
        ValueError, before any tensor is read: naming the config file (not DeepSeek, unknown
        RoPE type, bad fields, a ``"qkmla"`` record that is not valid), an override that
        contradicts the record, ``layers`` (out of range), the index file (a needed tensor is not
        listed), a shard file (missing, unreadable, or a tensor of the wrong shape), or norm
        tensors that disagree with the record (:func:`check_norm_tensors`).

    Examples:
        >>> mla = mla_layers_from_hf_dir("DeepSeek-V2-Lite", layers=3)[3]             # doctest: +SKIP
    """
    check_path_type(hf_dir, "a checkpoint directory")
    root = check_path("hf_dir", hf_dir, "checkpoint directory")  # an empty or over-long path, named
    if not root.is_dir():
        raise ValueError(f"hf_dir: {root} is not a directory")
    check_utf8_path("hf_dir", root)
    # Before any tensor is read: device='cuda' on a machine without one ended in torch's AssertionError
    # after the checks, and dtype=torch.int8 in nn.Module.to's TypeError.
    device = check_device("device", device)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected None (the stored dtype) or a floating torch.dtype, got {dtype!r}")
    hf_config = read_hf_config(root)
    check_dense(hf_config, f"hf_dir: {root / CONFIG}")
    try:
        config = mla_config_from_hf(hf_config, **overrides)
    except ValueError as e:  # the config's faults name the file; an override refused (qk_norm.eps) names it
        message = str(e)
        named = message.partition(":")[0].partition(".")[0]
        raise ValueError(message.replace("hf_config", str(root / CONFIG), 1) if named in overrides
                         else f"{root / CONFIG}: {message}") from None
    chosen = _check_layers(layers, hf_config.get("num_hidden_layers"), root / CONFIG)
    recorded = recorded_norm(hf_config, str(root / CONFIG))
    check_norm_tensors(root, hf_config, recorded)  # the record and the norm tensors agree, in every layer
    weight_map, listing = _weight_map(root)
    with torch.device("meta"):  # names and shapes without allocating anything
        shapes = {k: tuple(v.shape) for k, v in MLA(config).state_dict().items() if not k.startswith(_OURS)}
    if recorded is not None:  # the recorded norm's trained weights, under the names the layer gives them
        shapes.update(norm_tensor_shapes(config))
    stored_shapes = dict(shapes)
    grouped = config.num_kv_groups < config.num_heads
    if grouped:  # a GQA conversion stores each group's kv_b_proj rows repeated for its heads (hub.record)
        stored_shapes["kv_b_proj.weight"] = (config.num_heads * (config.qk_nope_head_dim + config.v_head_dim),
                                             config.kv_lora_rank)
    needed = {(layer, name): attention_prefix(layer) + name for layer in chosen for name in shapes}
    missing = [key for key in needed.values() if key not in weight_map]
    if missing:
        raise ValueError(f"{listing}: the attention tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                         f"are not listed ({len(missing)} missing)")
    files = sorted({weight_map[key] for key in needed.values()})
    absent = [f for f in files if not (root / f).is_file()]
    if absent:
        raise ValueError(f"{listing} names shard files that are not in {root}: {absent}")

    block = tuple((hf_config.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    with contextlib.ExitStack() as stack:
        shards = {f: stack.enter_context(_open(root / f)) for f in files}
        plan, stored = {}, None
        for (layer, name), key in needed.items():
            part = shards[weight_map[key]].get_slice(key)
            shape, kind = tuple(part.get_shape()), part.get_dtype()
            if shape != stored_shapes[name]:
                # An override that reshapes the layer (kv_lora_rank=64 on a checkpoint of 32) is the cause
                # the caller can act on: named first, not left for the reader to infer from the config's shape.
                sized = {k: v for k, v in overrides.items() if k in _SHAPE_FIELDS}
                if sized:
                    raise ValueError(f"{', '.join(sized)}: the override {sized} does not fit the weights: {key} in "
                                     f"{root / weight_map[key]} has shape {shape}, the overridden config needs "
                                     f"{stored_shapes[name]}; leave the sizes to {root / CONFIG}")
                raise ValueError(f"{root / weight_map[key]}: {key} has shape {shape}, the config in "
                                 f"{root / CONFIG} needs {stored_shapes[name]}")
            if not (kind.startswith("F") or kind == "BF16"):  # integer weights would be cast silently
                raise ValueError(f"{root / weight_map[key]}: {key} is stored as {kind}; attention weights are "
                                 f"floating point (or FP8 with a scale)")
            scale_key = key + "_scale_inv" if kind in _FP8 else None
            if scale_key is not None:
                want = tuple(math.ceil(n / b) for n, b in zip(shape, block))
                got = tuple(shards[weight_map[scale_key]].get_slice(scale_key).get_shape()) \
                    if weight_map.get(scale_key) in shards else None
                if got != want:
                    raise ValueError(f"{listing}: FP8 tensor {key} needs {scale_key} of shape {want} in a listed "
                                     f"shard, got {got}")
            plan[layer, name] = (key, scale_key)
            if name == "kv_b_proj.weight" and stored is None:
                stored = torch.bfloat16 if kind in _FP8 else None
        modules = {}
        for layer in chosen:
            tensors = {}
            for name in shapes:
                key, scale_key = plan[layer, name]
                t = shards[weight_map[key]].get_tensor(key)
                if scale_key is not None:
                    t = _dequantize(t, shards[weight_map[scale_key]].get_tensor(scale_key), block)
                if grouped and name == "kv_b_proj.weight":
                    t = unrepeat_groups(t, config, f"{root / weight_map[key]}: {key}")
                tensors[name] = t
            target = dtype or stored or tensors["kv_b_proj.weight"].dtype
            mla = MLA(config).to(device=device, dtype=target)
            with torch.no_grad():
                for name, p in list(mla.named_parameters()) + list(mla.named_buffers()):
                    if name in tensors:
                        p.copy_(tensors[name])
            modules[layer] = mla
    return modules


def read_hf_tensors(hf_dir: Union[str, Path], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Named tensors of a checkpoint directory (e.g. ``model.layers.3.input_layernorm.weight``), read lazily.

    Raises:
        ValueError: naming keys, and the index (a key is not listed), or the shard (missing or unreadable).
    """
    # one name given as keys was read as its characters: "['m', 'o', 'd', ...] are not listed"
    if isinstance(keys, (str, bytes)):
        raise ValueError(f"keys: expected tensor names (a list of str), got the {type(keys).__name__} {keys!r:.80}; "
                         f"pass [{keys!r:.80}] for one")
    root = Path(hf_dir)
    weight_map, listing = _weight_map(root)
    keys = list(keys)
    missing = [k for k in keys if k not in weight_map]
    if missing:
        raise ValueError(f"keys: {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}) not listed in "
                         f"{listing}")
    out = {}
    for file in sorted({weight_map[k] for k in keys}):
        if not (root / file).is_file():
            raise ValueError(f"{listing} names shard file {file}, which is not in {root}")
        with _open(root / file) as f:
            out.update({k: f.get_tensor(k) for k in keys if weight_map[k] == file})
    return out


# The ``layer_types`` of MLA layers: a hybrid's "full_attention" ones (Kimi-Linear, Ling; its
# "linear_attention" ones are not MLA), and a sparse attention model's "indexed_attention" (every
# layer of DeepSeek-V3.2 and GLM-5's DSA)
MLA_LAYER_TYPES = ("full_attention", "indexed_attention")


def norm_tensor_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """{name under ``self_attn.``: shape} of the weights a layer with ``config``'s norm adds, read from
    the norms it builds (with the projection scope a weight has a row per query head or KV group)."""
    q_norm, k_norm = qk_norms_of(config)
    shapes = {f"{side}.{block}.weight": tuple(getattr(norm, block).weight.shape)
              for side, norm in (("q_norm", q_norm), ("k_norm", k_norm)) if norm is not None
              for block in ("content", "rope")}
    return shapes | ({"logit_scale": (config.num_heads,)} if config.learnable_logit_scale else {})


def check_shards(hf_dir: Union[str, Path]) -> None:
    """Every shard file the checkpoint lists is there and reads as safetensors (its header only, which
    safetensors checks against the file's size: a cut file is caught here, without reading a weight).
    transformers' loader met a truncated shard as a SafetensorError traceback, "internal error" in
    ``qkmla generate --hf``.

    Raises:
        ValueError naming the file: a shard missing, or not readable as safetensors.
    """
    root = Path(hf_dir)
    weight_map, listing = _weight_map(root)
    for file in sorted(set(weight_map.values())):
        if not (root / file).is_file():
            raise ValueError(f"hf_dir: {listing} names shard file {file}, which is not in {root}")
        with _open(root / file):
            pass


def check_norm_tensors(hf_dir: Union[str, Path], hf_config: dict, norm: Optional[QKNormConfig]) -> dict[str, str]:
    """Before any weight is read: the checkpoint holds exactly the norm weights its config records,
    with the right shapes (from the safetensors headers). Returns {tensor name: shard file}.

    Raises:
        ValueError: naming the file, for a norm recorded whose weights are missing, norm weights
            whose norm is not recorded, or a weight of the wrong shape.
    """
    root = Path(hf_dir)
    weight_map, listing = _weight_map(root)
    found = {k for k in weight_map if _NORM_KEY.search(k)}
    groups = recorded_groups(hf_config, str(root / CONFIG))
    # (only the widths are read: any MLA family's config gives them as DeepSeek's does)
    config = mla_config_from_hf(hf_config, qk_norm=norm, any_model_type=True, any_rope_type=True,
                                **({GROUPS: groups} if groups is not None else {}))
    # LongCat-Flash counts its layers as num_layers, and has two attention modules in each (self_attn.0, .1): its
    # checkpoints failed here in range(None), a TypeError, plain or QK-normed
    layers = hf_config.get("num_hidden_layers") or hf_config.get("num_layers")
    kinds = hf_config.get("layer_types")  # a hybrid's: only its MLA layers have a norm (MLA_LAYER_TYPES)
    modules = {}  # layer -> its MLA attention modules' prefixes, as the weights name them
    for key in weight_map:
        if (m := _MLA_MODULE.match(key)) is not None:
            modules.setdefault(int(m.group(1)), set()).add(m.group(2))
    shapes = {f"model.layers.{i}.{module}{n}": s
              for i in range(layers) if not kinds or kinds[i] in MLA_LAYER_TYPES
              for module in sorted(modules.get(i) or {"self_attn."})  # none: a layer missing, reported below
              for n, s in norm_tensor_shapes(config).items()}
    if norm is None and found:
        raise ValueError(f"hf_dir: {listing} holds QK-norm weights ({sorted(found)[0]}, ...: {len(found)}) but "
                         f"{root / CONFIG} records no norm (its {RECORD!r} entry is missing); the config and the "
                         f"weights are from different models")
    records = {k for k in found if k.endswith("._extra_state")}  # the variant record of each norm (optional)
    found -= records
    missing, extra = sorted(set(shapes) - found), sorted(found - set(shapes))
    if missing or extra:
        raise ValueError(f"hf_dir: {root / CONFIG} records the norm {describe(norm)} but {listing} "
                         + (f"lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)} missing)"
                            if missing else f"also holds {extra[:3]} ({len(extra)} not of that norm)"))
    files = {}
    for name, shape in shapes.items():
        file = weight_map[name]
        if not (root / file).is_file():
            raise ValueError(f"hf_dir: {listing} names shard file {file}, which is not in {root}")
        with _open(root / file) as f:
            got = tuple(f.get_slice(name).get_shape())
            # A few values per layer, read here: a NaN norm weight loaded without a word, and torch's fused
            # attention on the CPU turned its NaN scores into finite logits (0.25 off the undamaged checkpoint's)
            bad = int((~torch.isfinite(f.get_tensor(name).float())).sum()) if got == shape else 0
        if got != shape:
            raise ValueError(f"hf_dir: {root / file}: {name} has shape {got}; the config in {root / CONFIG} needs "
                             f"{shape}")
        if bad:
            raise ValueError(f"hf_dir: {root / file}: {name} holds {bad} values that are not finite (NaN or inf); "
                             f"the QK norm's weights scale every query or key, so the checkpoint is damaged")
        files[name] = file
    if records:
        want = norm.name if norm is not None and norm.kind is not None else None
        for name in sorted(records):
            with _open(root / weight_map[name]) as f:
                got = bytes(f.get_tensor(name).tolist()).decode("ascii", "replace")
            if got != want:
                raise ValueError(f"hf_dir: {root / weight_map[name]}: {name} says its weights belong to a {got} QK "
                                 f"norm, but {root / CONFIG} records {describe(norm)}")
    return files


def saved_norm(hf_dir: Union[str, Path], name: Optional[str] = None) -> Optional[QKNormConfig]:
    """The QK norm a checkpoint directory's config.json records (None for none); a record that is not valid
    refused naming ``name`` (the caller's argument for the directory) and the file, or the file alone."""
    root = Path(hf_dir)
    where = f"{name}: {root / CONFIG}" if name else str(root / CONFIG)
    return recorded_norm(read_hf_config(root, name or "hf_dir"), where)
