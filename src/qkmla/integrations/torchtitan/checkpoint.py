"""torchtitan DeepSeek-V3 models to and from Hugging Face DeepSeek-V3 checkpoint directories, with
qkmla's QK norm: train with torchtitan, serve or evaluate with transformers (``export_hf``), and
continue pretraining from an HF checkpoint, plain or QK-normed by qkmla (``import_hf``).

Every stock tensor goes through torchtitan's own ``DeepSeekV3StateDictAdapter`` (its ``to_hf`` /
``from_hf``: names, per-expert split and stack); only what :class:`~.attention.QKAttention` adds is
renamed here, to the names qkmla's transformers integration loads (``hub/record.py``):

    layers.{i}.attention.q_head_norm.{content,rope}.weight  <->  model.layers.{i}.self_attn.q_norm.{...}.weight
    layers.{i}.attention.k_head_norm.{content,rope}.weight  <->  model.layers.{i}.self_attn.k_norm.{...}.weight
    layers.{i}.attention.logit_scale [h]                     <->  model.layers.{i}.self_attn.logit_scale
    (and each norm's ``_extra_state``, the variant record that ``check_norm_tensors`` verifies)

with the norm recorded in config.json (``"qkmla": {"qk_norm": ...}``, ``"attn_implementation"``), so
that ``qkmla.integrations.transformers.from_pretrained(dir)`` loads it and transformers alone refuses it.

An exported checkpoint computes the same function in transformers, to float rounding, or is refused
before anything is written. What transformers' DeepSeek-V3 fixes and torchtitan leaves free:

* routing: sigmoid scores (``router.score_func="sigmoid"``), group-limited top-k with the bias
  only choosing (``num_expert_groups`` / ``num_limited_groups`` -> ``n_group`` / ``topk_group``; none ->
  1 / 1), ``route_norm`` -> ``norm_topk_prob`` (the same + 1e-20), ``route_scale`` ->
  ``routed_scaling_factor``, scores applied to the expert outputs (torchtitan's dispatchers all do);
  shared experts always present, their width a multiple of the routed experts' (``n_shared_experts``);
* the layer pattern: dense layers first, then MoE layers (``first_k_dense_replace``), one setting of
  each for all layers, and of attention; no MTP layers; no biases; one attention kind in all layers;
* norms: ``kv_a_layernorm`` / ``q_a_layernorm`` are built with eps 1e-6 whatever the config says (torchtitan's
  ``RMSNorm.Config`` default is 1e-5: build the latent norms with ``eps=1e-6``); the layer and final
  norms share one ``rms_norm_eps``;
* RoPE: ``ComplexRoPE`` rotates adjacent pairs (``rope_interleave: true``; torchtitan's adapter takes no
  other); YaRN's ``rope_factor``, ``original_seq_len``, ``beta_fast`` / ``beta_slow`` and ``truncate`` map to
  ``rope_scaling``; torchtitan's ``mscale`` m multiplies the softmax scale by (0.1 m ln s + 1)^2 and leaves
  cos/sin alone, which is HF's ``mscale = mscale_all_dim = m`` (the cos/sin factor is their ratio, 1).

torchtitan's ``GroupedExperts`` computes the routed experts in bfloat16 whatever the parameters'
dtype; transformers computes them in the model's dtype, so logits of MoE layers agree to bfloat16
rounding unless the experts run in float32 (the tests use such a subclass). QK-Clip changes only
weights, so its models export like any other.

The model is one process's (no DTensor): gather a sharded model first. Nothing is sharded on disk:
one ``model.safetensors``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Union

from .versions import check_torchtitan

check_torchtitan()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter  # noqa: E402
from torchtitan.models.common.rope import ComplexRoPE  # noqa: E402
from torchtitan.models.deepseek_v3.model import Attention, DeepSeekV3Model  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter  # noqa: E402

from ...config import QKNormConfig  # noqa: E402
from ...utils.checked import check_bool  # noqa: E402
from ...utils.files import (check_path, check_writable, clear_stale, directory_state, make_directory,  # noqa: E402
                             output_directory, write_directory)
from ..hub.checkpoint import CONFIG, SINGLE, _open, _weight_map, read_hf_config, read_hf_tensors  # noqa: E402
from ..hub.config import hf_rope  # noqa: E402
from ..hub.checkpoint import check_norm_tensors, check_utf8_path  # noqa: E402
from ..hub.output import check_checkpoint_out  # noqa: E402
from ..hub.record import (QK_MODEL_TYPES, declaration, describe, record_norm, recorded_groups,  # noqa: E402
                          recorded_norm, stock_model_type, write_code)
from .attention import QKAttention  # noqa: E402

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
HF_LATENT_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV3RMSNorm's default eps
EXPERT_BIAS = "e_score_correction_bias"
# QKAttention's own tensors <-> qkmla's HF names (hub/record.py); the rest of each name (".content.weight",
# "._extra_state", "") is kept.
_TT_OURS = re.compile(r"^layers\.(\d+)\.attention\.(q_head_norm|k_head_norm|logit_scale)((?:\..*)?)$")
_HF_OURS = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm|logit_scale)((?:\..*)?)$")
_TO_HF = {"q_head_norm": "q_norm", "k_head_norm": "k_norm", "logit_scale": "logit_scale"}
_FROM_HF = {v: k for k, v in _TO_HF.items()}
# What an imported checkpoint's config.json must agree on with the model beyond the tensor shapes: the
# routing and RoPE (the latent and layer norms' eps are not compared: torchtitan's stock configs differ
# from DeepSeek's releases there, and continued pretraining adapts to them).
ROUTING_FIELDS = ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")


def _ours_to_hf(name: str) -> Optional[str]:
    """A torchtitan name of QKAttention's norm weights / logit scale as qkmla's HF name; None for a stock name."""
    m = _TT_OURS.match(name)
    return None if m is None else f"model.layers.{m[1]}.self_attn.{_TO_HF[m[2]]}{m[3]}"


def _ours_from_hf(name: str) -> Optional[str]:
    """qkmla's HF name of a norm weight / logit scale as torchtitan's; None for a stock name."""
    m = _HF_OURS.match(name)
    return None if m is None else f"layers.{m[1]}.attention.{_FROM_HF[m[2]]}{m[3]}"


def _uniform(values: dict[str, object], what: str, problems: list[str]):
    """The one value every layer has (``values``: {layer's setting name: value}); a problem otherwise."""
    first_name, first = next(iter(values.items()))
    for name, value in values.items():
        if value != first:
            problems.append(f"{name}: {value!r} differs from {first_name}={first!r}; HF DeepSeek-V3 has one {what} "
                            f"for every layer")
            break
    return first


def model_norm(model: DeepSeekV3Model) -> Optional[QKNormConfig]:
    """The QK norm of a torchtitan DeepSeek-V3 model's attention layers (None: stock ``Attention`` or a
    ``QKAttention`` without a norm, e.g. QK-Clip's).

    Raises:
        ValueError: naming the layers whose attention kinds or norms differ.
    """
    norms = {f"layers.{i}.attention": layer.attention.qk_norm if isinstance(layer.attention, QKAttention.Config)
             else None for i, layer in enumerate(model.config.layers)}
    first_name, first = next(iter(norms.items()))
    for name, norm in norms.items():
        if norm != first:
            raise ValueError(f"model: layers of mixed attention kinds: {name} has {describe(norm)}, {first_name} "
                             f"{describe(first)}; HF DeepSeek-V3 (and qkmla's record) has one for every layer")
    return first


def _rope_fields(rope, where: str, problems: list[str]) -> dict:
    """HF's rope fields of a torchtitan ``RoPE.Config``."""
    if type(rope) is not ComplexRoPE.Config:
        problems.append(f"{where}: a {type(rope).__qualname__}; HF conversion (torchtitan's adapter) takes "
                        f"ComplexRoPE.Config, whose adjacent pairs are HF's rope_interleave=true")
    fields = dict(rope_theta=float(rope.theta), max_position_embeddings=int(rope.max_seq_len), rope_interleave=True,
                  rope_scaling=None)
    if rope.scaling not in ("none", "yarn"):
        problems.append(f"{where}.scaling: {rope.scaling!r} has no HF DeepSeek-V3 equivalent; allowed: 'none', 'yarn'")
    elif rope.scaling == "yarn" and rope.rope_factor > 1.0:  # torchtitan scales nothing at a factor <= 1
        fields["rope_scaling"] = dict(type="yarn", factor=float(rope.rope_factor),
                                      original_max_position_embeddings=int(rope.original_seq_len),
                                      beta_fast=float(rope.beta_fast), beta_slow=float(rope.beta_slow),
                                      **({} if rope.truncate else {"truncate": False}))
    return fields


def _attention_fields(cfg, problems: list[str]) -> dict:
    """HF's attention and RoPE fields of a torchtitan DeepSeek-V3 config, the same in every layer."""
    per_layer = {}
    for i, layer in enumerate(cfg.layers):
        a, where = layer.attention, f"layers.{i}.attention"
        if not isinstance(a, Attention.Config):
            problems.append(f"{where}: a {type(a).__qualname__}; allowed: DeepSeek-V3's Attention.Config or "
                            f"qkmla's QKAttention.Config")
            return {}
        eps = {"kv_norm": a.kv_norm.eps} | ({"q_norm": a.q_norm.eps} if a.q_lora_rank else {})
        for norm, value in eps.items():
            if value != HF_LATENT_EPS:
                problems.append(f"{where}.{norm}.eps: transformers' DeepSeek-V3 builds its latent norms with eps "
                                f"{HF_LATENT_EPS:g}; allowed: {HF_LATENT_EPS:g}, got {value:g}")
        fields = dict(hidden_size=a.dim, num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads,
                      q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank,
                      qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                      v_head_dim=a.v_head_dim, **_rope_fields(a.rope, f"{where}.rope", problems))
        if fields["rope_scaling"] is not None:
            # softmax scale x mscale(s, m)^2, cos/sin untouched: HF's mscale_all_dim = m, and mscale = m
            # (HF's cos/sin factor is mscale(s, mscale) / mscale(s, mscale_all_dim), or mscale(s) when
            # either is 0: then it is given as 1).
            m = float(a.mscale)
            fields["rope_scaling"].update(mscale=m, mscale_all_dim=m, **({} if m else {"attention_factor": 1.0}))
        per_layer[where] = fields
    return _uniform(per_layer, "attention setting", problems)


def _ffn_hidden(ff, where: str, problems: list[str]) -> int:
    if type(ff) is not FeedForward.Config:
        problems.append(f"{where}: a {type(ff).__qualname__}; allowed: FeedForward.Config (SwiGLU, HF's MLP)")
    return ff.w1.out_features


def _moe_fields(cfg, problems: list[str]) -> dict:
    """HF's dense-MLP and MoE fields: dense layers first, then MoE layers, one setting of each."""
    kinds = ["moe" if layer.moe is not None else "dense" for layer in cfg.layers]
    first_k = kinds.index("moe") if "moe" in kinds else len(kinds)
    if "dense" in kinds[first_k:]:
        problems.append(f"layers.{first_k + kinds[first_k:].index('dense')}.feed_forward: a dense layer after the MoE "
                        f"layer layers.{first_k}; HF DeepSeek-V3 has its dense layers first (first_k_dense_replace)")
    dense = {f"layers.{i}.feed_forward.w1.out_features": _ffn_hidden(layer.feed_forward, f"layers.{i}.feed_forward",
                                                                     problems)
             for i, layer in enumerate(cfg.layers[:first_k])}
    moes = {}
    for i, layer in enumerate(cfg.layers[first_k:], start=first_k):
        m, where = layer.moe, f"layers.{i}.moe"
        r, experts = m.router, m.routed_experts.inner_experts
        if not isinstance(r, TokenChoiceTopKRouter.Config) or not isinstance(experts, GroupedExperts.Config):
            problems.append(f"{where}: router {type(r).__qualname__}, experts {type(experts).__qualname__}; allowed: "
                            f"TokenChoiceTopKRouter.Config and GroupedExperts.Config")
            continue
        if r.score_func != "sigmoid":
            problems.append(f"{where}.router.score_func: HF DeepSeek-V3 routes on sigmoid scores; allowed: "
                            f"'sigmoid', got {r.score_func!r}")
        if r._debug_force_load_balance:
            problems.append(f"{where}.router._debug_force_load_balance: allowed: False (HF routes by score)")
        if m.shared_experts is None:
            problems.append(f"{where}.shared_experts: None; HF DeepSeek-V3 always has shared experts; allowed: a "
                            f"FeedForward.Config of n x the routed experts' hidden_dim")
            continue
        shared = _ffn_hidden(m.shared_experts, f"{where}.shared_experts", problems)
        if shared % experts.hidden_dim:
            problems.append(f"{where}.shared_experts.w1.out_features: {shared} is not a multiple of the routed "
                            f"experts' hidden_dim {experts.hidden_dim} (HF: moe_intermediate_size x n_shared_experts)")
        if not m.num_experts == r.num_experts == experts.num_experts:
            problems.append(f"{where}: num_experts {m.num_experts}, router {r.num_experts}, experts "
                            f"{experts.num_experts}; allowed: one number")
        grouped = r.num_expert_groups is not None
        moes[where] = dict(n_routed_experts=experts.num_experts, moe_intermediate_size=experts.hidden_dim,
                           n_shared_experts=shared // experts.hidden_dim, num_experts_per_tok=r.top_k,
                           n_group=r.num_expert_groups if grouped else 1,
                           topk_group=r.num_limited_groups if grouped else 1,
                           norm_topk_prob=bool(r.route_norm), routed_scaling_factor=float(r.route_scale))
    # DeepSeek-V3's own config.json names its router: vLLM reads these two (its gate has the
    # score-correction bias only with "noaux_tc"), transformers computes that router whatever they say.
    fields = dict(first_k_dense_replace=first_k, topk_method="noaux_tc", scoring_func="sigmoid")
    if moes:
        fields |= _uniform(moes, "MoE setting", problems)
    else:  # no MoE layer: HF reads none of these
        fields |= dict(n_routed_experts=1, moe_intermediate_size=1, n_shared_experts=1, num_experts_per_tok=1,
                       n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    fields["intermediate_size"] = _uniform(dense, "dense MLP width", problems) if dense \
        else fields["moe_intermediate_size"]
    return fields


def hf_config_fields(model: DeepSeekV3Model) -> tuple[dict, list[str]]:
    """(config.json fields of HF's DeepSeek-V3 for ``model``, the settings HF cannot compute the same way).

    Each problem names the torchtitan setting (``layers.{i}...``) and what is allowed; the fields are
    as complete as the settings allow.
    """
    cfg, problems = model.config, []
    if getattr(cfg, "mtp_layers", None):
        problems.append(f"mtp_layers: {len(cfg.mtp_layers)} MTP layers; transformers' DeepSeek-V3 computes none; "
                        f"allowed: [] (export the main model's config without them)")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            problems.append(f"{name}.bias: HF DeepSeek-V3's projections have no bias; allowed: "
                            f"Linear.Config(bias=False)")
            break
        if isinstance(module, nn.RMSNorm) and not module.elementwise_affine:
            problems.append(f"{name}.elementwise_affine: allowed: True (HF's RMSNorms have weights)")
            break
    eps = {f"layers.{i}.{n}.eps": getattr(layer, n).eps for i, layer in enumerate(cfg.layers)
           for n in ("attention_norm", "ffn_norm")} | {"norm.eps": cfg.norm.eps}
    fields = dict(model_type=MODEL_TYPE, architectures=[ARCHITECTURE], vocab_size=cfg.vocab_size,
                  num_hidden_layers=len(cfg.layers), hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                  rms_norm_eps=float(_uniform(eps, "RMSNorm eps", problems)), num_nextn_predict_layers=0,
                  tie_word_embeddings=bool(cfg.enable_weight_tying), bos_token_id=None, eos_token_id=None,
                  use_cache=True)
    fields |= _attention_fields(cfg, problems) | _moe_fields(cfg, problems)
    if fields.get("hidden_size", cfg.dim) != cfg.dim:
        problems.append(f"dim: {cfg.dim}, but the attention layers' dim is {fields['hidden_size']}; allowed: one")
    return fields, problems


def _stock_and_ours(state: dict) -> tuple[dict, dict]:
    """A torchtitan state dict split into (torchtitan's tensors, QKAttention's under qkmla's HF names)."""
    stock, ours = {}, {}
    for name, tensor in state.items():
        hf = _ours_to_hf(name)
        if hf is None:
            stock[name] = tensor
        else:
            ours[hf] = tensor
    return stock, ours


def _hf_state(model: DeepSeekV3Model) -> dict[str, torch.Tensor]:
    """The model's tensors under HF names (views of its own, experts split per expert); torchtitan's adapter
    for the stock ones, a zero expert bias where the model keeps none (HF's router always has one), no
    ``lm_head.weight`` when tied (HF ties it)."""
    state = model.state_dict()
    sharded = next((k for k, v in state.items() if isinstance(v, DTensor)), None)
    if sharded is not None:
        raise ValueError(f"model: {sharded} is a DTensor; export a model gathered on one process (full tensors)")
    stock, ours = _stock_and_ours(state)
    hf = DeepSeekV3StateDictAdapter(model.config, None).to_hf(stock) | ours
    for i, layer in enumerate(model.config.layers):
        key = f"model.layers.{i}.mlp.gate.{EXPERT_BIAS}"
        if layer.moe is not None and key not in hf:
            hf[key] = torch.zeros(layer.moe.num_experts, dtype=torch.float32)
    if model.config.enable_weight_tying:
        hf.pop("lm_head.weight", None)
    return hf


def export_hf(model: DeepSeekV3Model, out_dir: Union[str, Path], *, overwrite: bool = False,
              dtype: Optional[torch.dtype] = None, source: Union[None, str, Path] = None) -> Path:
    """Write a torchtitan DeepSeek-V3 model (stock ``Attention`` or qkmla's ``QKAttention`` layers) as a
    Hugging Face DeepSeek-V3 checkpoint directory: config.json and model.safetensors. A plain model is
    a stock DeepSeek-V3 checkpoint (transformers' ``AutoModelForCausalLM``); a QK-normed one declares
    qkmla's model (``qkmla_deepseek_v3``, ``QKNormDeepseekV3ForCausalLM``, its ``auto_map`` and
    ``modeling_qkmla.py``, qkmla's record of the norm), which ``AutoModelForCausalLM`` loads with
    ``qkmla.integrations.transformers`` imported, as ``qkmla.integrations.transformers.from_pretrained``
    does.

    Args:
        model: a built torchtitan ``DeepSeekV3Model`` (its ``config`` describes it), on one process.
        out_dir: the directory to create; written beside it under a temporary name, then renamed.
        overwrite: replace an existing ``out_dir`` that holds a checkpoint and nothing else (never a file, a
            training run, a directory of other files, or ``source``).
        dtype: the stored floating dtype; None keeps each tensor's (the expert bias stays float32, as
            DeepSeek's releases store it).
        source: the directory the model's weights were read from (the export command's DCP step
            directory): ``out_dir`` may not be it, inside it, or hold it.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError, before anything is written: ``out_dir`` is not empty (without ``overwrite``), cannot be
        replaced or written (:func:`check_export_out`), a sharded
        model, or any setting transformers' DeepSeek-V3 computes differently (each named, with what is
        allowed; see the module docstring).
    """
    out = check_export_out(out_dir, overwrite, source)
    state = directory_state(out)  # what the checks saw: another writer of out_dir meanwhile is refused at the rename
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")
    norm = model_norm(model)
    fields, problems = hf_config_fields(model)
    if problems:
        raise ValueError("model: transformers' DeepSeek-V3 cannot compute this model the same way: "
                         + "; ".join(problems))
    hf = _hf_state(model)
    tensors = {}
    for name, t in hf.items():  # own storage for each (safetensors refuses shared memory), contiguous
        keep = not t.is_floating_point() or dtype is None or name.endswith(EXPERT_BIAS)
        tensors[name] = t.detach().to(device="cpu", dtype=None if keep else dtype).contiguous().clone()
    stored = tensors["model.embed_tokens.weight"].dtype
    if norm is not None:  # a model of its own: qkmla's model type, architecture and auto_map (hub.record)
        fields.update(declaration(MODEL_TYPE))
    config = SimpleNamespace(**fields, dtype=str(stored).removeprefix("torch."))
    record_norm(config, norm)  # qkmla's record (and loader) for a QK-normed model; nothing for a plain one

    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        (tmp / CONFIG).write_text(json.dumps(vars(config), indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / SINGLE), metadata={"format": "pt"})
        if norm is not None:
            write_code(tmp)  # modeling_qkmla.py, which the auto_map names

    # As every qkmla command writes a directory: whole or not at all, the umask's modes (not
    # mkdtemp's 0700 and safetensors' 0600), a killed export's leftovers swept by the next.
    return write_directory(out, write, state, name="out_dir")


def check_export_out(out_dir, overwrite: bool, source=None) -> Path:
    """The directory :func:`export_hf` writes for ``out_dir``, checked before any work as ``qkmla convert``
    checks its --out (:func:`~qkmla.integrations.hub.output.check_checkpoint_out`): ValueError naming out_dir for
    an empty, over-long or non-UTF-8 path, a file, ``source`` or a directory around it, a non-empty directory without
    ``overwrite`` or holding anything but a checkpoint this export writes (overwrite=True replaced a user's
    file, a training run and a directory of notes whole), and a parent it cannot write in (a bare
    PermissionError after the model was converted). A link of the user's own is followed
    (:func:`~qkmla.utils.files.output_directory`)."""
    check_bool("overwrite", overwrite)  # first: "no" is truthy, and clear_stale below is work
    given = check_path("out_dir", out_dir, "checkpoint directory")
    # As qkmla convert's --out: a name that is not UTF-8 was written whole, and then every reader of the
    # export refused it (from_pretrained, import_hf: safetensors and tokenizers take UTF-8 paths only).
    check_utf8_path("out_dir", given)
    out = output_directory("out_dir", given)
    clear_stale(out)  # what an export killed outright left, so that out is checked as it really is
    check_checkpoint_out(out, given, Path(source) if source is not None else None, overwrite, name="out_dir",
                         flag="overwrite=True", writer="export", copies_source=False)
    make_directory("out_dir", out.parent)
    check_writable("out_dir", out.parent)
    return out


def import_hf(hf_dir: Union[str, Path], model: DeepSeekV3Model) -> None:
    """Load a Hugging Face DeepSeek-V3 checkpoint directory (plain, or QK-normed by qkmla) into a built
    torchtitan DeepSeek-V3 model, in place, to continue pretraining from it.

    Everything is checked before any weight is read: the recorded norm against the norm tensors
    (``check_norm_tensors``) and against the model's; the routing and RoPE against the model's; every
    tensor name (none missing, none unexpected) and shape against the model's. Stock tensors go through
    torchtitan's ``DeepSeekV3StateDictAdapter.from_hf``.

    Args:
        hf_dir: config.json and safetensors weights (sharded or not), e.g. from :func:`export_hf` or
            transformers' ``save_pretrained``.
        model: a built torchtitan ``DeepSeekV3Model`` of the same shapes (its values are replaced;
            tensors are cast to its dtypes).

    Raises:
        ValueError: naming ``hf_dir``'s file and the model's setting, for a model type other than
            deepseek_v3, FP8 weights, a GQA-converted record, a norm recorded but not in the tensors (or
            the reverse), a model whose QK norm is not the recorded one (plain vs normed, or another
            variant), other routing or RoPE, missing / unexpected tensors or shapes, or a nonzero expert
            bias for a model that keeps none.
    """
    root = Path(hf_dir)
    if not root.is_dir():
        raise ValueError(f"hf_dir: {root} is not a directory")
    hf_config, where = read_hf_config(root), root / CONFIG
    if stock_model_type(hf_config.get("model_type")) != MODEL_TYPE:
        raise ValueError(f"hf_dir: {where} describes a {hf_config.get('model_type')!r} model; allowed: {MODEL_TYPE!r} "
                         f"and qkmla's {QK_MODEL_TYPES[MODEL_TYPE]!r}")
    if hf_config.get("quantization_config"):
        raise ValueError(f"hf_dir: {where} has a quantization_config (FP8 weights); allowed: unquantized weights "
                         f"(dequantize first)")
    saved = recorded_norm(hf_config, str(where))
    if recorded_groups(hf_config, str(where)) is not None:
        raise ValueError(f"hf_dir: {where} records a GQA conversion (num_kv_groups); torchtitan's MLA has one group "
                         f"per head; allowed: a checkpoint without num_kv_groups")
    check_norm_tensors(root, hf_config, saved)
    ours = model_norm(model)
    if ours != saved:
        raise ValueError(f"hf_dir: {where} records {describe(saved)}, but model's attention layers have "
                         f"{describe(ours)}; build the model with the recorded norm (QKAttention.Config(qk_norm=...), "
                         f"or stock Attention for none)")
    _check_function(hf_config, where, model)

    expected = {k: tuple(v.shape) for k, v in _hf_state(model).items()}
    weight_map, listing = _weight_map(root)
    records = {k for k in weight_map if _ours_from_hf(k) is not None and k.endswith("._extra_state")}
    optional = records | ({"lm_head.weight"} if model.config.enable_weight_tying else set())
    missing = sorted(set(expected) - set(weight_map))
    extra = sorted(set(weight_map) - set(expected) - optional)
    if missing or extra:
        raise ValueError(f"hf_dir: {listing} does not hold model's tensors: missing {missing[:4]} ({len(missing)}), "
                         f"unexpected {extra[:4]} ({len(extra)})")
    for name, shape in expected.items():
        with _open(root / weight_map[name]) as f:
            got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise ValueError(f"hf_dir: {root / weight_map[name]}: {name} has shape {got}; model needs {shape}")

    hf = read_hf_tensors(root, sorted(set(expected) | (optional & set(weight_map))))
    stock, own = {}, {}
    for name, tensor in hf.items():
        tt = _ours_from_hf(name)
        (stock if tt is None else own)[name if tt is None else tt] = tensor
    tied = model.config.enable_weight_tying
    if tied and "lm_head.weight" in stock:
        if not torch.equal(stock.pop("lm_head.weight"), stock["model.embed_tokens.weight"]):
            raise ValueError(f"hf_dir: {listing}: lm_head.weight differs from model.embed_tokens.weight, but model "
                             f"ties them (enable_weight_tying); allowed: equal tensors, or no lm_head.weight")
    state = DeepSeekV3StateDictAdapter(model.config, None).from_hf(stock) | own
    if tied:
        state["lm_head.weight"] = state["tok_embeddings.weight"]
    own_state = model.state_dict()
    for i, layer in enumerate(model.config.layers):
        key = f"layers.{i}.moe.expert_bias_E"
        if layer.moe is not None and key not in own_state and key in state:
            if torch.count_nonzero(state.pop(key)):
                raise ValueError(f"hf_dir: model.layers.{i}.mlp.gate.{EXPERT_BIAS} is nonzero, but model's "
                                 f"layers.{i}.moe keeps no expert bias (load_balance_coeff=None); allowed: a model "
                                 f"with load_balance_coeff set")
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


def _check_function(hf_config: dict, where: Path, model: DeepSeekV3Model) -> None:
    """The checkpoint's routing and RoPE are the model's (what the tensor shapes cannot tell)."""
    fields, problems = hf_config_fields(model)
    routing = [p for p in problems if ".router." in p]
    if routing:
        raise ValueError(f"model: {routing[0]}")
    theirs = hf_rope(hf_config)
    mine = hf_rope(fields) if "rope_theta" in fields else theirs
    if theirs != mine or hf_config.get("rope_interleave", True) is not True:
        raise ValueError(f"hf_dir: {where} has RoPE theta={theirs[0]:g}, scaling={theirs[1]}, "
                         f"rope_interleave={hf_config.get('rope_interleave', True)}; model's is theta={mine[0]:g}, "
                         f"scaling={mine[1]}, interleaved (ComplexRoPE)")
    if fields.get("first_k_dense_replace", 0) < len(model.config.layers):  # a MoE layer: its routing
        differ = [f"{k}={hf_config.get(k)!r} (model: {fields[k]!r})" for k in ROUTING_FIELDS
                  if hf_config.get(k) != fields[k]]
        if differ:
            raise ValueError(f"hf_dir: {where} routes otherwise than model: {', '.join(differ)}")


__all__ = ["export_hf", "hf_config_fields", "import_hf", "model_norm"]
