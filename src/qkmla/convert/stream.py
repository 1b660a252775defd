"""A checkpoint converted without being held: its shards copied one at a time, its decoder layers
loaded and run one at a time.

The checkpoints people add a QK norm to (DeepSeek-V3/R1, Kimi K2: 671B to 1T parameters) do not fit
in a machine's memory, and adding a norm changes none of their tensors: it adds a few small ones
and a record. So :func:`~qkmla.convert.qk_norm.convert_checkpoint` works through a
:class:`CheckpointStream`:

* the weights (:func:`write_weights`): every source shard copied byte for byte (or, for a new
  dtype, read, cast and written one shard at a time), renumbered ``model-0000k-of-0000n``, the norm
  weights a shard of their own, one index naming them all;
* the calibration (:func:`calibrate_streaming`): each decoder layer loaded by transformers into a
  one-layer model of the checkpoint's family (:meth:`CheckpointStream.layer`: transformers' own
  loading, so its weight conversions, the experts' layout among them, apply as they would to the
  whole model), patched, calibrated on the hidden states the calibrated layers before it gave, run
  on each stream of hidden states, and freed. The embedding, final norm and LM head are read alone
  when they are needed.

Peak memory is about one shard (casting) or one decoder layer (calibrating; twice one layer while
transformers merges the experts), plus the hidden states of the calibration tokens: not the model.
``benchmarks/bench_convert_memory.py`` measures it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from ..config import QKNormConfig
from ..integrations.hub.checkpoint import (CONFIG, INDEX, _open, _weight_map, check_layers_present, check_routing,
                                           read_hf_config, transformers_config)

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
NORM_TENSORS = ("self_attn.q_norm.", "self_attn.k_norm.", "self_attn.logit_scale")  # what a norm adds to a layer
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_CLASSES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
_NOT_ARCHITECTURE = ("_scale_inv", "rotary_emb.inv_freq")  # an FP8 block scale; a buffer older saves kept


@contextlib.contextmanager
def _quiet_loading():
    """transformers' load report (each one-layer model misses the embedding and LM head, and has no
    other layers) and progress bar, silenced while the layers load."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


@contextlib.contextmanager
def _meta_build():
    """Modules built on the meta device, only for their shapes, without torch's warnings about their storage: a
    hand-edited config.json (kv_lora_rank 0) printed "UserWarning: Initializing zero-element tensors is a no-op"
    and its source line above the one-line refusal that check_shapes then gives (probe14 C22)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _buildable(config):
    """A copy of ``config`` that transformers' DeepSeek class builds: a QK-normed checkpoint's config
    records qkmla's loader as its attn_implementation (record.LOADER, a guard against loading it as
    the plain model), which the class refuses, so ``qkmla convert`` of a checkpoint it wrote (a
    re-save, as the --qk-norm refusal advises) failed as "describes a model transformers cannot
    build". The config written keeps the guard."""
    from ..integrations.hub.record import LOADER

    one = copy.deepcopy(config)
    if getattr(one, "_attn_implementation", None) in (LOADER, "qkmla.interop.from_pretrained"):
        one._attn_implementation = None
    return one


class CheckpointStream:
    """A transformers DeepSeek-V2/V3 checkpoint directory read a tensor or a decoder layer at a time.

    Args:
        root: the checkpoint directory (config.json and safetensors shards).
        dtype: the dtype layers are computed in; None: the checkpoint's own (its config's ``dtype``),
            float32 where it records none.
    """

    def __init__(self, root: Path, dtype: Optional[torch.dtype] = None):
        import transformers

        from ..integrations.hub.record import stock_model_type
        from ..integrations.transformers import auto  # noqa: F401  (qkmla's model types, for AutoConfig)

        self.root = Path(root)
        # first, before any work: its values (num_hidden_layers 2**70 hung the layer build below)
        read_hf_config(self.root)
        self.weight_map, self.listing = _weight_map(self.root)
        self.shards: dict[str, list[str]] = {}  # shard file -> its tensor names, in the index's order
        for name, file in self.weight_map.items():
            self.shards.setdefault(file, []).append(name)
        self.config = transformers_config(self.root)  # transformers' own words (no model_type) named no option
        model_type = stock_model_type(self.config.model_type)
        if model_type not in _CLASSES:
            raise ValueError(f"hf_dir: {self.root / CONFIG} describes a {self.config.model_type!r} model; qkmla "
                             f"converts {tuple(_CLASSES)}")
        self.model_class = getattr(transformers, _CLASSES[model_type])
        self.num_layers = self.config.num_hidden_layers
        stored = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = getattr(torch, stored, None)
        self.dtype = dtype or (stored if isinstance(stored, torch.dtype) else torch.float32)
        try:
            with _meta_build():  # the whole model's structure, no storage: what each layer must load as
                self._meta = self.model_class._from_config(_buildable(self.config))
        except (RuntimeError, ValueError, TypeError, ArithmeticError) as e:
            # a hand-edited size (kv_lora_rank -1; qk_nope_head_dim -8: a head dim of 0 to the power -0.5)
            # failed in torch as an internal error, with its traceback
            raise ValueError(f"hf_dir: {self.root / CONFIG} describes a model transformers cannot build "
                             f"({str(e).splitlines()[0]})") from None
        self.check_routing()
        self.check_shapes()

    def check_routing(self) -> None:
        """:func:`~qkmla.integrations.hub.checkpoint.check_routing` of the checkpoint's config."""
        check_routing(self.config, self.root / CONFIG, self.num_layers)

    def check_shapes(self) -> None:
        """Before any weight is read: every tensor the whole model has under the checkpoint's own name
        (all but those transformers converts on loading, such as per-expert weights) has the model's
        shape in the shard headers, and the embedding and final norm are there. ValueError naming
        the tensor and its file otherwise."""
        want = {k: tuple(v.shape) for k, v in self._meta.state_dict().items()}
        for name in (EMBED, FINAL_NORM):
            if name not in self.weight_map:
                raise ValueError(f"hf_dir: {self.listing} has no tensor {name!r}")
        check_layers_present(self.root, {"num_hidden_layers": self.num_layers})
        self.check_no_foreign_tensors(want)
        for file in sorted(self.shards):
            with _open(self.root / file) as f:
                for name in (k for k in self.shards[file] if k in want):
                    got = tuple(f.get_slice(name).get_shape())
                    if got != want[name]:
                        raise ValueError(f"hf_dir: {self.root / file}: {name} has shape {got}; the config in "
                                         f"{self.root / CONFIG} needs {want[name]}")

    def check_no_foreign_tensors(self, want: dict) -> None:
        """Every tensor of a decoder layer has a place in the declared class: a DeepSeek-V3 checkpoint whose
        config.json says deepseek_v2 (its gates' e_score_correction_bias) was converted as V2 and written, exit 0,
        its routing silently another. Per-expert weights are the class's fused ``experts`` (transformers joins them
        on loading); a QK norm's tensors, an FP8 block scale, a stale RoPE buffer and layers past
        ``num_hidden_layers`` (V3's multi-token-prediction layer) are not the class's weights and say nothing."""
        layer = re.compile(r"model\.layers\.(\d+)\.")
        expert = re.compile(r"(.*\.experts\.)\d+\.")
        foreign = []
        for name in self.weight_map:
            m = layer.match(name)
            if m is None or int(m.group(1)) >= self.num_layers or name in want or name.endswith(_NOT_ARCHITECTURE) \
                    or any(t in name for t in NORM_TENSORS):
                continue
            e = expert.match(name)
            if e is None or not any(k.startswith(e.group(1)) for k in want):
                foreign.append(name)
        if foreign:
            raise ValueError(f"hf_dir: {self.listing} holds tensors a {self.model_class.__name__} (model_type "
                             f"{self.config.model_type!r} in {self.root / CONFIG}) has no place for: {foreign[:3]} "
                             f"({len(foreign)} in all); they were saved by another architecture: give config.json "
                             f"the model_type of the model that saved them")

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the checkpoint, in the compute dtype (read from its shard alone)."""
        if name not in self.weight_map:
            raise ValueError(f"hf_dir: {self.listing} has no tensor {name!r}")
        with _open(self.root / self.weight_map[name]) as f:
            return f.get_tensor(name).to(self.dtype)

    def layer_config(self, index: int, moe: bool):
        """The checkpoint's config with one decoder layer, built as a dense (``moe`` False) or MoE
        layer, a 2-token vocabulary (the embedding and LM head are not used) and the per-layer lists
        (``layer_types`` and the like) cut to layer ``index``'s entry."""
        one = _buildable(self.config)
        for name, value in vars(self.config).items():
            if isinstance(value, list) and len(value) == self.num_layers and name != "architectures":
                setattr(one, name, [value[index]])
        one.num_hidden_layers, one.vocab_size, one.tie_word_embeddings = 1, 2, False
        one.first_k_dense_replace = 0 if moe else 1
        if hasattr(one, "moe_layer_freq"):
            one.moe_layer_freq = 1
        return one

    def _one_layer_config(self, index: int):
        """The layer config whose decoder layer has the same structure as the whole model's layer ``index``."""
        want = {k: tuple(v.shape) for k, v in self._meta.model.layers[index].state_dict().items()}
        for moe in (False, True):
            config = self.layer_config(index, moe)
            with _meta_build():
                layer = self.model_class._from_config(config).model.layers[0]
            if {k: tuple(v.shape) for k, v in layer.state_dict().items()} == want:
                return config
        raise ValueError(f"hf_dir: decoder layer {index} of {self.root / CONFIG} is neither the dense nor the MoE "
                         f"layer a one-layer model of its config builds; qkmla cannot load it alone")

    def layer(self, index: int):
        """Decoder layer ``index`` as a one-layer model of the checkpoint's class, its weights loaded by
        transformers from the checkpoint's tensors of that layer (a QK norm's tensors left out: the
        caller adds the norm), with no final norm (its output is the layer's), in eval mode. ValueError naming the checkpoint if the layer's tensors
        are missing or of the wrong shapes."""
        from ..integrations.transformers.load import _experts_for_dtype

        prefix = f"model.layers.{index}."
        names = [k for k in self.weight_map if k.startswith(prefix) and not any(t in k for t in NORM_TENSORS)]
        state = {}
        for file in sorted({self.weight_map[k] for k in names}):
            with _open(self.root / file) as f:
                state.update({"model.layers.0." + k[len(prefix):]: f.get_tensor(k)
                              for k in names if self.weight_map[k] == file})
        config = self._one_layer_config(index)
        with _quiet_loading():
            try:
                model, info = self.model_class.from_pretrained(None, config=config, state_dict=state, dtype=self.dtype,
                                                               attn_implementation="eager", output_loading_info=True)
            except RuntimeError as e:  # shapes that disagree with the config (transformers' load report)
                raise ValueError(f"hf_dir: layer {index} of {self.root} does not load as its config describes it: "
                                 f"{str(e).strip().splitlines()[0][:300]}") from None
        del state
        missing = sorted(k for k in info["missing_keys"] if k.startswith("model.layers.0."))
        if missing:
            raise ValueError(f"hf_dir: {self.listing} lacks tensors of layer {index}: "
                             f"{[prefix + k[len('model.layers.0.'):] for k in missing[:3]]} ({len(missing)} missing)")
        model.model.norm = torch.nn.Identity()  # its output is the layer's: the final norm is the whole model's
        # A float64 MoE layer's experts computed eagerly: grouped_mm takes no float64, and `qkmla convert --dtype
        # float64` (or a float64 checkpoint) calibrating an MoE model ended in its RuntimeError, "internal error"
        _experts_for_dtype(model, None)
        return model.eval()

    def layers(self) -> Iterator:
        for index in range(self.num_layers):
            yield index, self.layer(index)


def _run_layer(model, hidden: torch.Tensor) -> torch.Tensor:
    """A one-layer model's decoder layer on hidden states [B, T, hidden] (positions 0..T-1, causal):
    its output (:meth:`CheckpointStream.layer` leaves the final norm out)."""
    return model.model(inputs_embeds=hidden, use_cache=False).last_hidden_state


def causal_lm_losses(stream: CheckpointStream, hidden: dict[str, torch.Tensor], ids: torch.Tensor) -> dict:
    """{name: the next-token loss transformers' causal LM gives} (mean over every predicted token,
    logits in float32) for each last layer's output [B, T, hidden] in ``hidden``: the final norm
    (the model's own class) and the LM head read from the checkpoint once, the vocabulary-wide
    logits computed a row at a time."""
    weight = stream.tensor(LM_HEAD if LM_HEAD in stream.weight_map else EMBED)
    meta_norm = stream._meta.model.norm
    norm = type(meta_norm)(meta_norm.weight.shape[0], eps=stream.config.rms_norm_eps)
    norm.weight = torch.nn.Parameter(stream.tensor(FINAL_NORM), requires_grad=False)
    losses = {}
    for name, h_all in hidden.items():
        total, count = 0.0, 0
        for h, row in zip(h_all, ids):
            logits = (norm(h) @ weight.T).float()
            total += float(F.cross_entropy(logits[:-1], row[1:], reduction="sum"))
            count += row.numel() - 1
        losses[name] = total / count
    return losses


def calibrate_streaming(stream: CheckpointStream, norm: QKNormConfig, input_ids: Optional[torch.Tensor],
                        held_out_ids: Optional[torch.Tensor] = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Add ``norm`` to every layer of the checkpoint and calibrate it layer by layer: the report and
    the norm's tensors of :func:`~qkmla.convert.calibrate.warm_start_qk_norm` on the whole model.

    Args:
        input_ids: the calibration batch [B, T]; None leaves the norm weights at ones.
        held_out_ids: [B', T'] token ids on which the next-token loss is measured: of the source
            (the norm taken out), with the norm at unit weights, and calibrated. None skips them.

    Returns:
        (report, {tensor name: tensor}): the report as ``warm_start_qk_norm`` gives it ({} without a
        calibration batch), and every layer's norm tensors under the names ``save_pretrained`` gives
        them.
    """
    from ..integrations.transformers.model import apply_latent_attention
    from ..integrations.transformers.patched import latent_layers
    from .calibrate import calibrate_layer, unit_weights, without_norm

    embed = stream.tensor(EMBED) if input_ids is not None else None
    h_cal = F.embedding(input_ids, embed) if input_ids is not None else None
    held = F.embedding(held_out_ids, embed) if held_out_ids is not None and embed is not None else None
    del embed
    streams = dict.fromkeys(("source", "unit_weights", "calibrated"), held) if held is not None else {}
    reports, tensors, current = {}, {}, [0]

    def calibrate(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        positions = kwargs.get("position_ids")
        positions = positions if positions is not None else torch.arange(x.shape[1])
        reports[current[0]] = calibrate_layer(module, x, positions.expand(*x.shape[:2]))

    with torch.no_grad():
        for index, model in stream.layers():
            apply_latent_attention(model, qk_norm=norm)
            (layer,) = latent_layers(model)
            current[0] = index
            if h_cal is not None:
                if streams:
                    with without_norm([layer]):
                        streams["source"] = _run_layer(model, streams["source"])
                    unit_weights(layer)
                    streams["unit_weights"] = _run_layer(model, streams["unit_weights"])
                hook = layer.register_forward_pre_hook(calibrate, with_kwargs=True)
                try:  # each layer calibrated on what the calibrated layers before it give
                    h_cal = _run_layer(model, h_cal)
                finally:
                    hook.remove()
                if streams:
                    streams["calibrated"] = _run_layer(model, streams["calibrated"])
            tensors.update({f"model.layers.{index}.self_attn.{k}": v.detach().clone()
                            for k, v in layer.state_dict().items()
                            if any(f"self_attn.{k}".startswith(t) for t in NORM_TENSORS)})
            del model, layer
        loss = causal_lm_losses(stream, streams, held_out_ids) if streams else {}
    if h_cal is None:
        return {}, tensors
    return {"layers": dict(sorted(reports.items())), "loss": loss or None, "tokens": input_ids.numel()}, tensors


def keeps_float32(name: str, patterns) -> bool:
    """Whether transformers keeps tensor ``name`` in float32 whatever the dtype asked for (a model
    class's ``_keep_in_fp32_modules(_strict)``: module names matched whole, between dots)."""
    return any(re.search(rf"(^|\.){re.escape(p)}($|\.)", name) for p in patterns)


def float32_modules(model_class, dtype: Optional[torch.dtype]) -> list[str]:
    """The modules transformers loads in float32 when asked for ``dtype``: a class's
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16, its ``_keep_in_fp32_modules`` for float16."""
    strict = list(getattr(model_class, "_keep_in_fp32_modules_strict", None) or [])
    loose = list(getattr(model_class, "_keep_in_fp32_modules", None) or [])
    return strict + loose if dtype == torch.float16 else strict if dtype == torch.bfloat16 else []


def _cast_shard(source: Path, target: Path, dtype: torch.dtype, float32_patterns) -> None:
    from ..utils.files import save_safetensors

    with _open(source) as f:
        metadata = f.metadata()
        tensors = {}
        for name in f.keys():
            t = f.get_tensor(name)
            if t.is_floating_point() and t.element_size() > 1 and t.dtype != dtype:
                t = t.to(torch.float32 if keeps_float32(name, float32_patterns) else dtype)
            tensors[name] = t
    save_safetensors(tensors, target, metadata=metadata or {"format": "pt"})


def _sizes(path: Path) -> dict[str, int]:
    """{tensor name: bytes} from a safetensors file's header."""
    out = {}
    with _open(path) as f:
        for name in f.keys():
            s = f.get_slice(name)
            numel = 1
            for d in s.get_shape():
                numel *= d
            out[name] = numel * _BYTES.get(s.get_dtype(), 1)
    return out


def write_weights(stream: CheckpointStream, out: Path, extra: dict[str, torch.Tensor],
                  dtype: Optional[torch.dtype] = None) -> dict[str, str]:
    """The source's shards into directory ``out``, one at a time: copied as they are, or cast to
    ``dtype`` (floating tensors, but those the model class keeps in float32; FP8 and integer tensors
    as they are), renamed ``model-0000k-of-0000n.safetensors``; ``extra`` (the norm's tensors) as the
    last shard; the index naming every tensor's shard. Returns the weight map written."""
    from ..utils.files import save_safetensors, write_text

    files = sorted(stream.shards)
    count = len(files) + bool(extra)
    names = {file: f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k, file in enumerate(files)}
    keep = float32_modules(stream.model_class, dtype)
    weight_map, total = {}, 0
    for file in files:
        target = out / names[file]
        if dtype is None:
            shutil.copyfile(stream.root / file, target)
        else:
            _cast_shard(stream.root / file, target, dtype, keep)
        sizes = _sizes(target)
        total += sum(sizes.values())
        weight_map.update(dict.fromkeys(stream.shards[file], names[file]))
    if extra:
        last = f"model-{count:05d}-of-{count:05d}.safetensors"
        save_safetensors({k: v.contiguous() for k, v in extra.items()}, out / last, metadata={"format": "pt"})
        total += sum(_sizes(out / last).values())
        weight_map.update(dict.fromkeys(extra, last))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text(out / INDEX, json.dumps(index, indent=2) + "\n")
    return weight_map


def copy_other_files(root: Path, out: Path, skip) -> list[str]:
    """Every other top-level file of the checkpoint (tokenizer, generation config, README, ...) copied
    into ``out``: those named in ``skip`` and the weights are written by the conversion itself."""
    copied = []
    for path in sorted(root.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name not in skip \
                and path.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
            shutil.copyfile(path, out / path.name)
            copied.append(path.name)
    return copied


__all__ = ["CheckpointStream", "calibrate_streaming", "causal_lm_losses", "copy_other_files", "keeps_float32",
           "write_weights"]
