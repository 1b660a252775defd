"""A whole transformers MLA model (DeepSeek-V2/V3 and the families of ``families``) decoding through
qkmla's latent cache.

    model = DeepseekV3ForCausalLM.from_pretrained(path)
    apply_latent_attention(model)                      # in place; returns the model
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

:func:`apply_latent_attention` swaps every MLA attention module (``self_attn``; each of LongCat-Flash's
two; a hybrid's MLA layers only, its linear attention staying transformers' own) for a
:class:`~qkmla.integrations.transformers.attention.LatentAttention` that adopts the layer's own projection
modules (no copy: ``state_dict()`` keys and tensors stay transformers' own) and registers two
hooks on the inner ``*Model``:

* before its forward: the caller's 2-D ``attention_mask`` says which of the call's new tokens
  are real; that goes down to the layers with transformers' own keyword arguments
  (``qkmla_call=``, a :class:`~qkmla.integrations.transformers.attention.LatentCall`), so nothing of one call
  is kept on the model for the next (gradient checkpointing's recompute, a nested call and
  another thread see their own). A forward that caches gets a
  :class:`~qkmla.integrations.transformers.cache.LatentAttentionCache` (or its empty ``DynamicCache`` becomes
  one); a training forward with no cache passed caches nothing unless it asks (``use_cache=True``, as
  transformers' own model caches then; not the config's default); ``position_ids`` of another
  shape than the call's tokens are refused (their values are honoured, whatever they are). A call that packs several sequences into a batch row
  (transformers' padding-free format: ``position_ids`` restarting with no ``attention_mask``, or
  the flash-attention kwargs ``cu_seq_lens_q/k``) attends within each sequence, caches nothing,
  and is refused with a cache.
* the mask transformers builds for its own attention functions is not needed, so the model's
  attention implementation becomes ``"qkmla_latent"``, whose mask function builds none (a
  padded 32k prompt would otherwise get a [B, 1, T, T] mask).

On the model object it is given, switching the attention implementation
(``set_attn_implementation``) and transformers' continuous batching (``generate_batch``, which
runs transformers' attention functions over a paged cache of keys and values) are refused
before any work; ``generate`` on a padded batch is what serves many prompts.

Embeddings, MLP and MoE, the final norm, the LM head and the generation utilities stay
transformers' own. transformers' attention-function registry is not used: it only ever
receives expanded keys and values, which the absorbed path never forms.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional, Union

import torch

from ...cache.eviction import EvictionPolicy
from ...config import QKNormConfig
from ...ops.mla_decode.backends import check_backend
from .attention import LatentAttention, LatentCall, LatentSettings
from .cache import (PREFIX_TUNING, QUANTIZED_INSTEAD, LatentAttentionCache, adopt_layer, check_cache,
                    check_cache_settings, model_dtype)
from .families import attention_slots, get_slot, set_slot
from .patched import inner_model, model_family
from ..hub.record import describe, record_norm, recorded_groups, recorded_norm

LATENT_IMPLEMENTATION = "qkmla_latent"
# How a family's MLA attention modules are built, by the name its row gives (``families.Family.build``):
# each takes (hf_attention, settings, hf_rotary=, host=, **MLAConfig overrides) and returns the layer.
def _sparse_from_hf(hf_attention, settings, **kwargs):
    from .sparse import SparseLatentAttention  # sparse.py imports this module's neighbours, not this module

    return SparseLatentAttention.from_hf(hf_attention, settings, **kwargs)


BUILDERS = {"dense": LatentAttention.from_hf, "sparse": _sparse_from_hf}


def apply_latent_attention(model, *, qk_norm: Union[None, str, QKNormConfig] = None, kv_format: str = "dense",
                           policy: Optional[EvictionPolicy] = None, decode_backend: str = "auto"):
    """Make a transformers MLA model attend and decode through qkmla, in place.

    Args:
        model: a ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``, a causal LM of another supported
            family (``families.FAMILIES``: GLM-4.7-Flash, Mistral 4, LongCat-Flash, MiniCPM3, Kimi-Linear,
            ...), or its inner ``*Model``. A family that is not supported (four of the sparse ones: the
            table's reasons) is refused naming the class and the reason, before any work.
        qk_norm: None (the model's own function) or a post-up-projection QK norm to add to every
            attention layer: a :class:`~qkmla.QKNormConfig` (kind, mode, p, eps, scope, learnable
            logit scale) or its shorthand, "rms" (the paper's), "l2" or "lp". The norm weights start at ones,
            which changes the model's function (calibrate them with
            ``qkmla.convert.warm_start_qk_norm``); they are recorded in the model's config, so
            ``save_pretrained`` writes them and ``qkmla.integrations.transformers.from_pretrained`` restores them
            (``qkmla.integrations.hub.record``).
        kv_format: how the caches the model makes for itself store the latent
            (``qkmla.kv_formats.KV_FORMATS``: "dense", "fp8", "int8", "int4").
        policy: an eviction policy those caches run (``qkmla.cache.StreamingLLM``, ``H2O``,
            ``SnapKV``), or None to keep every token.
        decode_backend: the decode op's backend ("auto", "torch", "cpu", "triton", "naive").

    Calling it again on a patched model changes ``kv_format``, ``policy`` and ``decode_backend``;
    it adds a QK norm to a model that has none, and refuses to change one the model has (its
    weights were trained for it): ``qk_norm=None`` keeps it.

    Returns:
        ``model``.
    """
    family = model_family(model)
    inner = inner_model(model)
    check_not_partitioned(model)
    check_not_offloaded(model)
    check_cache_settings(kv_format, policy, None, model_dtype(model))  # a bf16 model's rows are bf16
    check_backend(decode_backend, "decode_backend")
    norm = QKNormConfig.of(qk_norm)
    settings = getattr(inner, "_qkmla_settings", None)
    if settings is not None:  # already patched: new settings, and a norm if it has none
        current = recorded_norm(inner.config)
        if norm is not None and current is not None and norm != current:
            raise ValueError(f"qk_norm: this model already has the QK norm {describe(current)} (its weights are "
                             f"trained for it), so it cannot become {describe(norm)}; pass qk_norm=None to keep it, "
                             f"or start from the model without a norm")
        settings.kv_format, settings.policy = kv_format, policy
        for slot in attention_slots(inner):
            if norm is not None and current is None:
                set_slot(slot, get_slot(slot).with_norm(norm))
            get_slot(slot).config = get_slot(slot).config.replace(decode_backend=decode_backend)
        if norm is not None and current is None:
            _record(model, norm)
        _keep_latent_attention(model)  # the causal LM, when the first call was given its inner model
        _adopt(inner, model)
        return model
    settings = LatentSettings(kv_format=kv_format, policy=policy)
    groups = recorded_groups(inner.config)  # a GQA conversion's G < h groups (hub.record, transformers.attention)
    overrides = {"num_kv_groups": groups} if groups is not None else {}
    slots = _checked_slots(family, inner, type(model).__name__)
    host = family.host(inner.config)
    build = BUILDERS[family.build]
    patched = [build(get_slot(slot), settings, hf_rotary=getattr(inner, "rotary_emb", None), host=host,
                     decode_backend=decode_backend, qk_norm=norm, **overrides)
               for slot in slots]
    for slot, attn in zip(slots, patched):
        set_slot(slot, attn)
    inner._qkmla_settings = settings
    _record(model, norm)
    inner._qkmla_signature = inspect.signature(inner.forward)
    inner.register_forward_pre_hook(_before_forward, with_kwargs=True)
    if model is not inner:
        model.register_forward_pre_hook(_before_lm_forward, with_kwargs=True)
    inner.register_forward_hook(_after_forward, with_kwargs=True)
    _no_transformers_mask(model)
    _keep_latent_attention(model)
    _adopt(inner, model)
    return model


def _checked_slots(family, inner, name: str) -> list:
    """The MLA attention modules of ``inner`` (``families.attention_slots``), checked against the
    family's config: the decoder layers its config calls MLA are the ones that have MLA's structure."""
    slots = attention_slots(inner)
    expected = family.mla_layers(inner.config)
    found = [False] * len(inner.layers)
    for i, layer in enumerate(inner.layers):
        found[i] = any(owner is layer or owner is getattr(layer, "self_attn", None) for owner, _ in slots)
    if not slots or found != list(expected)[:len(found)]:
        raise ValueError(f"model: {name}'s config ({family.model_type}) makes decoder layers "
                         f"{[i for i, e in enumerate(expected) if e][:8]} MLA, but the layers with MLA's structure "
                         f"(kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj) are "
                         f"{[i for i, f in enumerate(found) if f][:8]}")
    return slots


def check_not_partitioned(model) -> None:
    """Refuse, before any work, a model whose attention weights are split across processes, which the
    latent attention does not support: by DeepSpeed ZeRO-3, because its absorbed decode reads
    ``kv_b_proj``'s weight (folded into the query and the output) outside that module's forward,
    where ZeRO-3 holds only a placeholder and gathers the weight for the module's own forward alone;
    by transformers' tensor parallelism (``tp_plan``) when the plan shards the attention (DeepSeek-V2's
    does, by heads), because it needs every head's rows of ``kv_b_proj`` on each process. A plan that
    shards only the MLP and experts (DeepSeek-V3's) leaves the attention whole on every process and is
    supported; ZeRO-1/2 and DDP keep every weight whole on every process."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled() or any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("model: its weights are partitioned by DeepSpeed ZeRO-3, which qkmla's latent attention "
                         "does not support (its absorbed decode reads kv_b_proj's weight outside that module's "
                         "forward, where ZeRO-3 leaves a placeholder); train with ZeRO-2 or FSDP, or load the "
                         "model without ZeRO-3 to patch and decode it")
    tp_size = getattr(model, "_tp_size", None)
    if tp_size is None or tp_size <= 1:
        return
    plans = (getattr(model, "_tp_plan", None), getattr(inner_model(model), "_tp_plan", None),
             getattr(model.config, "base_model_tp_plan", None))
    sharded = sorted({k for plan in plans if plan for k in plan if "self_attn" in k})
    if sharded:
        raise ValueError(f"model: transformers' tensor parallelism (tp_plan, {tp_size} processes) shards its "
                         f"attention ({sharded[0]}, ...), which qkmla's latent attention does not support (it needs "
                         f"every head's kv_b_proj rows on each process); load it without tp_plan")


def check_not_offloaded(model, name: str = "model") -> None:
    """Refuse, before any work, a model whose attention weights accelerate offloads (``device_map`` with "disk",
    or a CPU offload beside a GPU): they stay on the meta device and a hook brings them in only inside each
    projection's own forward, where the latent attention reads kv_b_proj's weight outside it and its QK norm has
    no hook; the first forward failed as "x: the module's weights are on meta and x is on cpu", naming an
    argument the caller never gave. ``name``: the argument that placed them."""
    for slot in attention_slots(inner_model(model)):
        attn = get_slot(slot)
        if any(p.is_meta for p in attn.parameters()) and any(hasattr(m, "_hf_hook") for m in attn.modules()):
            where = f"layer {attn.layer_idx}" if isinstance(getattr(attn, "layer_idx", None), int) else "a layer"
            raise ValueError(f"{name}: {where}'s attention weights are offloaded by accelerate (kept on the meta "
                             f"device and brought in only inside each projection's forward), which qkmla's latent "
                             f"attention cannot read (its decode folds kv_b_proj's weight outside that forward); "
                             f"place every layer on a device (a device_map without \"disk\", or enough max_memory)")


def _configs(model) -> list:
    """The model's config objects: the causal LM's and the inner model's, once each (usually one)."""
    return list({id(c): c for c in (model.config, inner_model(model).config)}.values())


def _record(model, norm: Optional[QKNormConfig]) -> None:
    """Record the norm in every config object the model has (``save_pretrained`` writes it)."""
    for config in _configs(model):
        record_norm(config, norm)


def _no_transformers_mask(model) -> None:
    """Register and select the ``"qkmla_latent"`` attention implementation: its mask function
    builds nothing, and its attention function (never called: the layers are qkmla's) refuses."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(*args, **kwargs):
        raise ValueError("attn_implementation: 'qkmla_latent' is qkmla's latent attention, which only "
                         "qkmla.integrations.transformers.attention.LatentAttention layers compute")

    AttentionInterface.register(LATENT_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(LATENT_IMPLEMENTATION, lambda *args, **kwargs: None)
    for config in _configs(model):
        config._attn_implementation = LATENT_IMPLEMENTATION


def _keep_latent_attention(model) -> None:
    """Refuse, on this model object, what would need transformers' attention functions: switching
    the attention implementation (``set_attn_implementation``) and continuous batching
    (``init_continuous_batching``, which ``generate_batch`` and ``continuous_batching_context_manager``
    call first). Set on the instance, so other models stay stock."""
    model.set_attn_implementation = _set_attn_implementation
    if hasattr(model, "init_continuous_batching"):  # the causal LM (transformers' GenerationMixin)
        model.init_continuous_batching = _no_continuous_batching
    if hasattr(model, "generate"):
        model.create_masks_for_generate = _masks_for_generate
        model._prepare_cache_for_generation = _PrepareCache(model)


class _WeakModel:
    """A model held weakly (a strong reference from the model's own attribute made a cycle, and ``del model`` freed
    nothing until the next garbage collection); a deepcopy's or a pickled copy's is the copy's. A dead reference
    (the model collected, its inner model kept) copies and pickles as one: deepcopy and torch.load of such an inner
    model failed in weakref ("cannot create weak reference to 'NoneType' object")."""

    def __init__(self, model):
        self.model = weakref.ref(model) if model is not None else _dead

    def __deepcopy__(self, memo):  # the model's copy, registered in memo before its attributes are copied
        model = self.model()
        return type(self)(memo.get(id(model), model))

    def __reduce__(self):  # pickled with the model (pickle's memo resolves the cycle); unpickled, held weakly again
        return type(self), (self.model(),)


def _dead():
    return None


class _Owner(_WeakModel):
    """The model ``apply_latent_attention`` was given (the causal LM, or the inner model itself), as its inner
    model's forward hook reads it: PEFT copies its adapters' ``peft_config`` onto that model, and calls its
    ``forward`` directly (no hook of its own runs)."""


def _adopt(inner, model) -> None:
    """Make ``model`` the owner of ``inner`` unless a live owner holds ``model`` (a second apply_latent_attention
    on the inner model, to change settings, re-pointed the hook at it, away from the causal LM PEFT copies its
    configs onto: a norm-trained adapter over a model without a norm was then taken without a word)."""
    held = getattr(inner, "_qkmla_owner", None)
    current = held.model() if held is not None else None
    if current is None or any(m is current for m in model.modules()):
        inner._qkmla_owner = _Owner(model)


class _PrepareCache(_WeakModel):
    """``generate``'s cache preparation on a patched model: ``cache_implementation="quantized"`` refused
    before transformers builds its cache. Building it needs optimum-quanto, and without it transformers'
    ImportError said to install that, for a cache the first forward then refused (``check_cache``).
    An object, not a bound method: deepcopy and pickle give the copy its own (a bound method pickles as a
    lookup on the model, which found the class's method, without the check). It holds the model weakly: a
    strong reference from the model's own attribute made a cycle, and ``del model`` freed nothing until the
    next garbage collection (GPU memory held after ``del model; torch.cuda.empty_cache()``)."""

    def __call__(self, generation_config, *args, **kwargs):
        if getattr(generation_config, "cache_implementation", None) == "quantized":
            raise ValueError(f"cache_implementation: \"quantized\" is transformers' QuantizedCache, "
                             f"{QUANTIZED_INSTEAD}")
        model = self.model()
        if model is None:  # copy.copy(model) shares the hook (its attributes are the original's), and it was deleted
            raise ValueError("model: a shallow copy (copy.copy) of a patched model whose original was deleted; copy a "
                             "patched model with copy.deepcopy, which gives the copy its own generate hook")
        return type(model)._prepare_cache_for_generation(model, generation_config, *args, **kwargs)


def _masks_for_generate(*args, attention_mask=None, inputs_embeds=None, **kwargs):
    """What ``generate`` passes a model whose cache is compileable (a static latent cache) as its
    ``attention_mask``, in place of transformers' 4-D mask (which the latent layers never read): the
    caller's 2-D mask when the new tokens include padding (a left-padded prompt), else None. Padding
    already written is remembered by the cache, so a decode step gets no mask, whose width would
    grow every step and recompile the step."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or inputs_embeds is None:
        return attention_mask
    return None if bool(attention_mask[:, -inputs_embeds.shape[1]:].all()) else attention_mask


def _set_attn_implementation(attn_implementation, *args, **kwargs) -> None:
    """``set_attn_implementation`` of a patched model: ``"qkmla_latent"`` (what it has) or refused."""
    requested = attn_implementation.get("", LATENT_IMPLEMENTATION) if isinstance(attn_implementation, dict) \
        else attn_implementation
    if requested != LATENT_IMPLEMENTATION:
        raise ValueError(f"attn_implementation: this model attends through qkmla's latent attention layers "
                         f"(apply_latent_attention; implementation {LATENT_IMPLEMENTATION!r}), which "
                         f"{requested!r:.40} would not replace: transformers would build masks the layers never "
                         f"read, and its continuous batching, which asks for this switch, still could not run them. "
                         f"Generate with model.generate (a padded batch is supported); for transformers' own "
                         f"attention, load the model again without apply_latent_attention")


def _no_continuous_batching(*args, **kwargs):
    """``init_continuous_batching`` of a patched model, where ``generate_batch`` starts: refused."""
    raise ValueError("generate_batch: transformers' continuous batching (generate_batch, init_continuous_batching, "
                     "continuous_batching_context_manager) runs transformers' attention functions over its own paged "
                     "cache of expanded keys and values, which qkmla's latent attention layers never call; it is not "
                     "supported on a model patched by apply_latent_attention. Use model.generate on a padded batch "
                     "(input_ids and attention_mask from a tokenizer with padding_side=\"left\", called with "
                     "padding=True): each prompt gets the tokens it gets alone, through the latent cache")


def _call_arguments(module, args, kwargs) -> dict:
    """The forward call's arguments by name (positional ones included)."""
    if not args:  # all by name already (transformers' own calls): no signature, which a compiled graph cannot read
        return dict(kwargs)
    signature = module._qkmla_signature
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        raise ValueError("model: pass its inputs by name (input_ids=..., attention_mask=...)") from None
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def _check_one_cache(arguments: dict) -> None:
    """Refuse two caches in one call. PEFT's prefix tuning under generate: transformers passes its cache as
    ``cache``, PEFT its virtual tokens as ``past_key_values``, and the causal LM reads the first alone: the
    prefix was ignored without a word, and generate gave the base model's tokens."""
    cache, held = arguments.get("cache"), arguments.get("past_key_values")
    if cache is None or held is None or cache is held:
        return
    filled = held.get_seq_length() if hasattr(held, "get_seq_length") else None
    raise ValueError("past_key_values: given beside cache, another cache"
                     + (f" already holding {int(filled)} tokens; {PREFIX_TUNING}" if filled else
                        "; pass one cache (cache=...)"))


def _before_lm_forward(module, args, kwargs):
    """The causal LM's forward: one cache (:func:`_check_one_cache`), before it picks one of the two."""
    _check_one_cache(kwargs)


def _before_forward(module, args, kwargs):
    arguments = _call_arguments(module, args, kwargs)
    settings: LatentSettings = module._qkmla_settings
    mask, position_ids = arguments.get("attention_mask"), arguments.get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4)):
        got = f"{mask.dim()}-D tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: qkmla's latent attention reads the 2-D padding mask [batch, length] "
                         f"(1 = token, 0 = padding) or a custom 4-D mask [batch, 1, new tokens, all tokens], got "
                         f"a {got}")
    custom = mask if mask is not None and mask.dim() == 4 else None
    if custom is not None:
        mask = None  # read as visible below; no token is padding (transformers passes the mask on as it is)
    asked = arguments.get("output_attentions")
    attentions = {} if (asked if asked is not None else getattr(module.config, "output_attentions", False)) else None
    if attentions is not None and settings.policy is not None:
        raise ValueError("output_attentions: this model's caches evict tokens (policy=...), so cached tokens no "
                         "longer match the attention_mask columns transformers' weights are laid out by; call "
                         "without output_attentions, or patch the model without a policy")
    owner = getattr(module, "_qkmla_owner", None)
    owner = owner.model() if owner is not None else None
    if getattr(owner, "peft_config", None):  # an unmerged PEFT model: merge_lora refused this one, but its forward
        # computed without the trained norm PEFT dropped (logits 0.08 from the fine-tuned model's), without a word
        from .lora import check_norms_have_a_place

        check_norms_have_a_place(owner, owner.peft_config, "model", active_only=True)
    both = [k for k in ("input_ids", "inputs_embeds") if arguments.get(k) is not None]
    if len(both) != 1:  # refused here, before a cache is made, as transformers refuses it, naming both
        raise ValueError(f"input_ids, inputs_embeds: the model takes exactly one of input_ids or inputs_embeds (as "
                         f"transformers' own model does), got {'both' if both else 'neither'}")
    given = both[0]
    inputs = arguments[given]
    batch_size, num_tokens = inputs.shape[:2]
    names = [n for n in ("cache", "past_key_values") if arguments.get(n) is not None]
    _check_one_cache(arguments)
    cache = arguments.get(names[0]) if names else None
    name = names[0] if names else ("cache" if "cache" in module._qkmla_signature.parameters else "past_key_values")
    asked = arguments.get("use_cache")
    use_cache = module.config.use_cache if asked is None else asked
    if cache is not None:  # a static or quantized transformers cache is refused before anything else
        check_cache(cache, name)
    if cache is not None and num_tokens == 0:
        # generate feeds the input_ids past the cache's columns: a cache passed with a prompt no longer than what it
        # holds (another conversation's) left none, refused as "position_ids: expected shape [batch=1, 0]", an
        # argument the caller never passed
        raise ValueError(f"{given}: no token past the {cache.get_seq_length()} columns {name} already holds; a "
                         f"cache continues the sequences it holds: pass {given} that extend them, a new cache, or "
                         f"call {name}.reset() first")
    documents, packed_by = _packed_documents(arguments, batch_size, num_tokens)
    if documents is not None and cache is not None:
        raise ValueError(f"{packed_by}: this call packs several sequences into a batch row (transformers' "
                         f"padding-free format: {packed_by} mark where each starts, no attention_mask), and a "
                         f"packed call cannot be cached: a cache row holds one sequence. Pass no {name} (a packed "
                         f"call without one caches nothing), or give each sequence a row of its own")
    if cache is None and use_cache:
        # A training forward caches nothing unless the caller asks (use_cache=True, not the config's default; the
        # loss of a training step needs no cache), and then gets one, as transformers' own model does: it returned
        # none, and a decode step given that None started a new sequence, without a word. Under gradient
        # checkpointing transformers turns use_cache off itself (its layers could not write a cache twice).
        checkpointing = getattr(module, "gradient_checkpointing", False) and torch.is_grad_enabled()
        if (module.training and (asked is not True or checkpointing)) or documents is not None:
            arguments["use_cache"] = False
        else:
            cache = arguments[name] = LatentAttentionCache(module)
    elif cache is not None:  # an empty transformers cache becomes a latent one, before any work
        for attn in (get_slot(slot) for slot in attention_slots(module)):
            adopt_layer(cache, attn.layer_idx, attn.config, settings.kv_format, settings.policy)
    if cache is not None:
        _derive_again_for_new_sequences(module, cache)
    past = cache.get_seq_length() if cache is not None and (mask is not None or custom is not None) else 0
    valid = _new_tokens(mask, batch_size, num_tokens, int(past))
    check_position_ids(position_ids, batch_size, num_tokens)
    visible = None
    if custom is not None:
        visible = _custom_visible(custom, batch_size, num_tokens, int(past))
        check_custom_mask_cache(cache, settings)
    arguments["qkmla_call"] = LatentCall(valid, documents, attentions, visible)
    return (), arguments


def _derive_again_for_new_sequences(inner, cache) -> None:
    """A call into an empty cache (generate's prefill, a new conversation) derives each layer's kept absorbed
    weights again. They are kept while the weights' version counters stand still, and a change made through
    ``.data`` (``p.data.copy_(w)``, a manual ``p.data -= lr * p.grad``) moves none: generate then decoded with
    the weights from before the change (other tokens, logits 1.45 off the unpatched model's), while a forward
    without a cache read the new ones. The kept weights are marked stale, not derived here: each layer derives
    them at its next use, where its weights are in place (an offloading hook loads them only then). A compiled
    step never starts a sequence here."""
    if torch.compiler.is_compiling() or int(cache.get_seq_length()):
        return
    for attn in (get_slot(slot) for slot in attention_slots(inner)):
        kept = getattr(attn, "_absorbed", None)
        if kept is not None:
            kept.key = None  # matches no parameters' version: derived again when next read (absorbed.DerivedWeights)


def _custom_visible(mask: torch.Tensor, batch_size: int, num_tokens: int, past: int) -> torch.Tensor:
    """[B, T, K] bool from a custom 4-D ``attention_mask`` [B or 1, 1, T, K] (K = past + T columns:
    the cached ones, then the call's), as transformers reads one: bool (True = seen) or an additive
    float mask (0 = seen, a large negative number = not)."""
    columns = past + num_tokens
    if mask.shape[0] not in (1, batch_size) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (num_tokens, columns):
        raise ValueError(f"attention_mask: a 4-D mask must be [batch={batch_size}, 1, {num_tokens}, {columns}] (the "
                         f"{num_tokens} new tokens by the {past} cached and {num_tokens} new columns), got "
                         f"{tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.dtype.is_floating_point:
        visible, hidden = mask == 0, mask <= torch.finfo(mask.dtype).min / 2
        if not bool((visible | hidden).all()):
            raise ValueError("attention_mask: an additive 4-D mask's entries must be 0 (seen) or a large negative "
                             "number (not seen); qkmla's latent attention does not add other biases to the logits")
    else:
        raise ValueError(f"attention_mask: a 4-D mask must be bool (True = seen) or float (additive: 0 = seen, a "
                         f"large negative number = not), got {mask.dtype}")
    return visible[:, 0].expand(batch_size, num_tokens, columns)


def check_custom_mask_cache(cache, settings: LatentSettings) -> None:
    """Refuse a custom 4-D mask with a cache it cannot be served over: a static latent cache (its
    compiled attention has one causal pattern) or a cache that evicts tokens (the mask's columns
    would no longer match the cached tokens)."""
    if cache is None:
        return
    from .static import StaticLatentCacheLayer

    # the static layers alone: a hybrid's cache also holds its linear-attention layers' state (Kimi-Linear,
    # Bailing), and a custom mask with one was refused as if it were a static cache, one the caller never passed
    if any(isinstance(layer, StaticLatentCacheLayer) for layer in cache.layers):
        raise ValueError("attention_mask: a custom 4-D mask is served over qkmla's growing latent cache; the static "
                         "latent cache (cache_implementation=\"static\") attends causally only. Pass a "
                         "LatentAttentionCache(model) or no cache")
    if settings.policy is not None:
        raise ValueError(f"attention_mask: a custom 4-D mask names columns of every token, and this model's caches "
                         f"evict tokens (policy={type(settings.policy).__name__}); patch the model with policy=None "
                         f"for custom masks")


def check_position_ids(position_ids, batch_size: int, num_tokens: int) -> None:
    """Refuse, before any work, ``position_ids`` that are not integers of shape [batch, T], [1, T]
    or [T] for a call of ``batch_size`` x ``num_tokens`` tokens. Their values are not checked:
    the latent cache rotates each token's RoPE key to the position given, as transformers'
    attention does (``LatentAttention``), so any numbering transformers accepts is honoured."""
    if position_ids is None:
        return
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point \
            or position_ids.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise ValueError(f"position_ids: expected an integer tensor [batch={batch_size}, {num_tokens}] (or [1, "
                         f"{num_tokens}]), got {position_ids!r:.80}")
    if tuple(position_ids.shape) not in ((batch_size, num_tokens), (1, num_tokens), (num_tokens,)):
        raise ValueError(f"position_ids: expected shape [batch={batch_size}, {num_tokens}] or [1, {num_tokens}] "
                         f"(one position per new token), got {tuple(position_ids.shape)}")


def _after_forward(module, args, kwargs, output):
    """With ``output_attentions``: the layers' weights (``LatentCall.attentions``) as the output's
    ``attentions``, in layer order (transformers' output recorder looks for its own attention class)."""
    call = kwargs.get("qkmla_call")
    if call is None or call.attentions is None or isinstance(output, tuple):
        return None
    output["attentions"] = tuple(call.attentions[get_slot(slot).layer_idx] for slot in attention_slots(module))
    return output


def _packed_documents(arguments: dict, batch_size: int, num_tokens: int) -> tuple[Optional[torch.Tensor], str]:
    """([B, T] which packed sequence each token belongs to, the argument that says so), or
    (None, "") when each batch row is one sequence.

    transformers' padding-free convention, read only without an ``attention_mask`` (a mask means
    padding, never packing, there too): the flash-attention varlen kwargs ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` when given (cumulative lengths over the flattened batch, as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` writes them), otherwise
    ``position_ids`` that do not count up by one (as transformers' ``find_packed_sequence_indices``,
    which its mask functions use, reads them). That function is not called: while being compiled it
    never answers "not packed" (it would report plain positions 0..T-1 as one packed sequence, so
    an ordinary call would cache nothing and be refused with a cache).
    """
    if arguments.get("attention_mask") is not None:
        return None, ""
    cu_q, cu_k = arguments.get("cu_seq_lens_q"), arguments.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        name = "cu_seq_lens_q" if cu_q is not None else "cu_seq_lens_k"
        return _documents_from_cu_seq_lens(cu_q, cu_k, batch_size, num_tokens), name
    position_ids = arguments.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or num_tokens < 2 \
            or position_ids.shape[1] != num_tokens or position_ids.shape[0] not in (1, batch_size):
        return None, ""
    restarts = position_ids.expand(batch_size, -1).diff(dim=-1) != 1  # [B, T - 1]: a sequence starts after
    if not bool(restarts.any()):
        return None, ""
    return torch.nn.functional.pad(restarts.long().cumsum(dim=-1), (1, 0)), "position_ids"


def _documents_from_cu_seq_lens(cu_q, cu_k, batch_size: int, num_tokens: int) -> torch.Tensor:
    """[B, T] sequence index of each token from cumulative sequence lengths over the B * T
    flattened tokens, checked: from 0 to B * T, non-decreasing, no sequence across two rows.
    Either may be given alone; messages name the one given (``cu_seq_lens_q`` when both are)."""
    name = "cu_seq_lens_q"
    if cu_q is None:
        cu_q, cu_k, name = cu_k, None, "cu_seq_lens_k"
    if not isinstance(cu_q, torch.Tensor) or cu_q.dim() != 1 or cu_q.dtype.is_floating_point or cu_q.numel() < 2:
        raise ValueError(f"{name}: expected a 1-D integer tensor of cumulative sequence lengths [0, l1, l1 + l2, "
                         f"...], got {cu_q!r:.80}")
    if cu_k is not None and (not isinstance(cu_k, torch.Tensor) or not torch.equal(cu_k.to(cu_q), cu_q)):
        raise ValueError(f"cu_seq_lens_k: without a cache every query sees its own sequence's keys, so it must "
                         f"equal cu_seq_lens_q ({cu_q.tolist()[:8]}), got {cu_k!r:.80}")
    total = batch_size * num_tokens
    bounds = cu_q.long()
    shown = bounds.tolist()[:8]
    if int(bounds[0]) != 0 or int(bounds[-1]) != total or bool((bounds.diff() < 0).any()):
        raise ValueError(f"{name}: cumulative sequence lengths {shown} must start at 0, not decrease and end at "
                         f"{total} (the {batch_size} x {num_tokens} tokens of this call)")
    rows = torch.arange(0, total + 1, num_tokens, device=bounds.device)
    if not bool(torch.isin(rows, bounds).all()):
        raise ValueError(f"{name}: cumulative sequence lengths {shown} put a sequence across two batch rows of "
                         f"{num_tokens} tokens; each row must hold whole sequences")
    flat = torch.arange(total, device=bounds.device)
    return (torch.searchsorted(bounds, flat, right=True) - 1).view(batch_size, num_tokens)


def _new_tokens(mask: Optional[torch.Tensor], batch_size: int, num_tokens: int, past: int) -> Optional[torch.Tensor]:
    """[B, T] bool, True for the real tokens among the call's T new ones (mask columns past..past+T-1,
    as transformers reads them), or None when all are real."""
    if mask is None:
        return None
    if mask.shape[0] != batch_size or mask.shape[1] < past + num_tokens:
        raise ValueError(f"attention_mask: expected [batch={batch_size}, at least {past + num_tokens}] (the "
                         f"{past} cached columns and {num_tokens} new tokens), got {tuple(mask.shape)}")
    valid = mask[:, past:past + num_tokens].bool()
    return None if bool(valid.all()) else valid
