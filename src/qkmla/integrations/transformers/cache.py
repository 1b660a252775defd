"""qkmla's latent cache as a transformers ``Cache``.

Each decoder layer's slot of a transformers ``Cache`` holds a :class:`LatentCacheLayer`: a
transformers cache layer (``CacheLayerMixin``) around one :class:`~qkmla.LatentCache` (latent,
RoPE key, key scalars; any ``kv_format``; an eviction ``policy``). transformers' generation
utilities reach it through the layer interface they already use, so ``generate`` (greedy,
sampling, beam search), ``reorder_cache``, ``crop``, ``batch_repeat_interleave`` and
``batch_select_indices`` work on it, and a cache passed back to ``generate`` continues the
conversation.

Two lengths are kept apart. transformers counts *columns*: every input position seen so far,
padding included (``get_seq_length``, the mask sizes, the slice of ``input_ids`` a continued
``generate`` feeds). The latent cache stores only real tokens, so each sequence has its own
length; ``stored`` [B, columns] records which columns were real, which is what a ``crop``
needs to take the right number of tokens off each sequence. Positions are a third numbering,
transformers' own: each token's RoPE key is cached rotated to the ``position_ids`` transformers
gave it (``LatentAttention``), whatever they are, so attention sees the position differences
transformers' attention sees.

:class:`LatentAttentionCache` is the whole cache, one latent layer per MLA attention layer (a
hybrid's linear-attention layers keep transformers' own state layers, which are never touched);
transformers' own ``DynamicCache`` is adopted when it arrives empty (``generate`` makes one by
default, and an offloading one for ``cache_implementation="offloaded"``): its layers are replaced
by latent layers, which offload as transformers' do when the cache offloads; an empty static cache
(``cache_implementation="static"``) gets static latent layers (``static.py``, compileable). A
layer that already holds transformers' keys and values, an offloading or sliding static cache,
or a quantized transformers layer, is refused (:func:`check_cache`), naming
``cache_implementation`` for the ones it makes.

Supported transformers: 5.4 to 5.24 (the cache-layer API took its present form in 5.0; a
QK-normed checkpoint is refused by transformers alone from 5.4 on, see hf_qknorm).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticLayer

try:  # transformers' linear-attention state (hybrids: Kimi-Linear, Ling), which stays transformers' own
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # transformers before its hybrid MLA families
    LinearAttentionCacheLayerMixin = ()

from ...cache.eviction import EvictionPolicy
from ...cache.latent import LatentCache
from ...config import MLAConfig
from ...kv_formats import check_kv_format
from ...utils.checked import INT64_MAX, FixedSettings, as_int, check_bool, is_int
from .patched import cache_slots, inner_model, model_settings
from .static import StaticLatentCacheLayer, check_crop, check_repeats, check_static_settings
from .view import TransformersView

GROW = 256  # a growing cache's capacity is a multiple of this many tokens
# The empty transformers layers a latent layer replaces: DynamicCache's, and its sparse attention
# models' (DeepSeek-V3.2: the indexer's keys beside keys and values; transformers >= 5.x only).
_DYNAMIC_LAYERS = tuple(c for c in (DynamicLayer, getattr(cache_utils, "DynamicIndexedLayer", None)) if c is not None)


def check_cache_settings(kv_format, policy, max_cache_len, dtype: Optional[torch.dtype] = None) -> None:
    """The arguments a latent cache is built from, checked before any work; ``dtype``: the model's, which a
    dense cache stores its rows in (None: not known yet)."""
    check_kv_format(kv_format)
    if policy is not None and not isinstance(policy, EvictionPolicy):
        raise ValueError(f"policy: expected an EvictionPolicy (qkmla.cache.StreamingLLM, H2O, SnapKV, or "
                         f"qkmla.cache.make_policy(name, ...)) or None, got {policy!r:.80}")
    # As LatentCache refuses it, but here, before any work: apply_latent_attention, LatentAttentionCache and
    # from_pretrained (after loading every weight) took it, and the first generate failed in the cache's constructor.
    quantized = kv_format != "dense" if isinstance(kv_format, str) else getattr(kv_format, "quantized", False)
    if policy is not None and getattr(policy, "reposition", False) and quantized:
        raise ValueError(f"policy: reposition=True re-rotates the stored RoPE keys at every eviction, which needs them "
                         f"in float32 or wider; a kv_format={kv_format!r} cache stores them in bfloat16. Use "
                         f"kv_format='dense' (in float32) or reposition=False")
    if policy is not None and getattr(policy, "reposition", False) and isinstance(dtype, torch.dtype) \
            and dtype.is_floating_point and dtype.itemsize < 4:  # the dense rows are the model's dtype
        raise ValueError(f"policy: reposition=True re-rotates the stored RoPE keys at every eviction, which needs them "
                         f"in float32 or wider; this model computes in {dtype}, and its dense cache stores them so. "
                         f"Use a float32 model or reposition=False")
    # Below 2**63 as the static cache's and LatentCache's capacities are: 2**70 was taken as a cap no cache can reach
    if max_cache_len is not None and (not is_int(max_cache_len) or not 1 <= max_cache_len <= INT64_MAX):
        raise ValueError(f"max_cache_len: expected a positive int below 2**63 (a fixed capacity) or None (grow as "
                         f"needed), got {max_cache_len!r}")


def model_dtype(model) -> Optional[torch.dtype]:
    """The dtype of ``model``'s first floating-point parameter (None: it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


class LatentCacheLayer(FixedSettings, TransformersView, CacheLayerMixin):
    """One decoder layer's latent cache, as a transformers cache layer.

    Args:
        config: the attention layer's :class:`~qkmla.MLAConfig` (the cache's row shape).
        kv_format: the latent's storage (``qkmla.kv_formats.KV_FORMATS``).
        policy: an eviction policy, or None to keep every token.
        max_cache_len: a fixed capacity in tokens per sequence; None grows as needed.
        offloading: keep the rows in CPU memory between this layer's forwards (transformers'
            ``offloaded`` cache): each forward brings them back to the model's device and sends
            them to the CPU when done (:meth:`prefetch`, :meth:`offload`).

    The :class:`~qkmla.LatentCache` is allocated by the first forward (which fixes the batch
    size, device and dtype) and grown by reallocation when it fills.
    """

    is_compileable = False
    is_sliding = False
    supports_early_init = False
    fixed_settings = ("config", "kv_format", "policy", "max_cache_len", "offloading")  # the rows are built from them

    def __init__(self, config: MLAConfig, kv_format: str = "dense", policy: Optional[EvictionPolicy] = None,
                 max_cache_len: Optional[int] = None, offloading: bool = False):
        super().__init__()
        check_cache_settings(kv_format, policy, max_cache_len)
        check_bool("offloading", offloading)  # "no" is truthy: bool() took it as True
        self.config, self.kv_format, self.policy, self.max_cache_len = config, kv_format, policy, max_cache_len
        self.offloading = offloading
        self.is_croppable = policy is None  # an evicted token cannot be put back
        self.latent: Optional[LatentCache] = None
        self.columns = 0
        self.stored: Optional[torch.Tensor] = None  # [B, columns] bool

    def __repr__(self) -> str:
        return f"LatentCacheLayer(kv_format={self.kv_format!r}, columns={self.columns}, latent={self.latent!r})"

    # -- transformers' cache-layer interface -----------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:
        raise ValueError("cache: a LatentCacheLayer is allocated by qkmla's attention on its first forward, "
                         "not from key/value shapes")

    def update(self, *args, **kwargs):
        raise ValueError("cache: this layer holds qkmla latent rows, written by qkmla's attention only; a "
                         "transformers attention layer cannot use it (call "
                         "qkmla.integrations.transformers.apply_latent_attention on the model)")

    def get_seq_length(self, *args) -> int:
        """Input columns seen so far, padding included (transformers' notion of the cache length)."""
        return self.columns

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv_length, kv_offset) for transformers' mask utilities; ``query_length`` is an int, or
        the ``cache_position`` tensor in older transformers."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.columns + int(query_length), 0

    def get_max_length(self) -> int:
        return self.max_cache_len if self.max_cache_len is not None else -1

    get_max_cache_shape = get_max_length  # the older name

    def reset(self) -> None:
        """Forget everything, batch size included (and the layer that wrote it: the next one that writes
        is the one its transformers view expands keys with): the next forward allocates anew."""
        self.latent, self.stored, self.columns, self.is_initialized = None, None, 0, False
        self.attention = None

    def offload(self) -> None:
        """Move the rows (latent and RoPE key, key scalars) to CPU memory; :meth:`prefetch`, or the
        layer's next forward, brings them back. The per-sequence counts (a few ints per sequence)
        stay where they are."""
        self._move_rows(torch.device("cpu"))

    def prefetch(self) -> None:
        """Bring offloaded rows back to the device the layer runs on."""
        if self.latent is not None:
            self._move_rows(self.latent.device)

    def _move_rows(self, device: torch.device) -> None:
        if self.latent is None:
            return
        for buffer in self.latent.fields.values():  # ContiguousBuffer: LatentCache.from_config's layout
            if buffer.data.device != device:
                buffer.data = buffer.data.to(device, non_blocking=True)

    @property
    def is_offloaded(self) -> bool:
        """Whether the rows are in CPU memory while the layer runs elsewhere (False before the first forward)."""
        return self.latent is not None and any(b.data.device != self.latent.device
                                               for b in self.latent.fields.values())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_repeats(repeats)
        if self.latent is not None:
            self._select(torch.arange(self.latent.batch_size, device=self.latent.device).repeat_interleave(repeats))

    def crop(self, tokens: int) -> None:
        """Drop the last ``-tokens`` columns (tokens < 0), or keep the first ``tokens`` (> 0: the
        meaning before transformers 5.15, deprecated since); 0 removes nothing. Each sequence
        loses the real tokens among the dropped columns."""
        tokens = check_crop(tokens)
        remove = -tokens if tokens <= 0 else self.columns - tokens
        remove = min(remove, self.columns)
        if remove <= 0 or self.latent is None:
            return
        if self.policy is not None:
            raise ValueError("cache: a latent cache with an eviction policy cannot be cropped (its evicted tokens "
                             "are gone); use policy=None for assisted or speculative decoding")
        self.latent.drop_last(self.stored[:, -remove:].sum(dim=1))
        self.stored, self.columns = self.stored[:, :-remove], self.columns - remove

    def rows_by_column(self) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(latent rows [B, K, d_c + d_r], key scalars [B, K, G] or None, ``stored`` [B, K]) over
        the K columns: each cached token's rows at its column, zeros at padding columns (for
        :class:`~.view.TransformersView`)."""
        latent, key_scale = self.latent.load()  # [B, S, ...]: each sequence's tokens in order
        stored = self.stored.to(latent.device)
        B, K, S = stored.shape[0], stored.shape[1], latent.shape[1]
        columns = torch.argsort((~stored).to(torch.int8), dim=1, stable=True)[:, :S]  # [B, S]: slot s's column
        filled = torch.arange(S, device=latent.device)[None] < stored.sum(dim=1, keepdim=True)

        def by_column(rows):
            rows = rows * filled[..., None].to(rows.dtype)
            return rows.new_zeros(B, K, rows.shape[-1]).scatter_(1, columns[..., None].expand_as(rows), rows)

        return by_column(latent), (by_column(key_scale) if key_scale is not None else None), stored

    @property
    def batch_size(self) -> int:
        if self.latent is None:
            raise AttributeError("batch_size: not allocated yet")  # hasattr() is False, as transformers expects
        return self.latent.batch_size

    def _select(self, indices: torch.Tensor) -> None:
        if self.latent is None:
            return
        indices = indices.to(self.latent.device)
        self.latent.select_sequences(indices)
        self.stored = self.stored[indices]

    # -- qkmla's side: what the attention layer calls --------------------------------------

    def reserve(self, batch_size: int, num_tokens: int, device, dtype: torch.dtype,
                config: Optional[MLAConfig] = None) -> LatentCache:
        """The latent cache, allocated or grown so that ``num_tokens`` more tokens of each of
        ``batch_size`` sequences fit; offloaded rows come back first. ``config``: the calling attention
        layer's, which shapes the rows (default: the one this layer was built for)."""
        # The caller's config, not the one this layer was built with: apply_latent_attention(model, qk_norm=...)
        # on a patched model adds a key scalar per token, and a cache built before (reset since) was allocated
        # without them and refused by every later call, cache.reset() included, with advice for LatentCache users
        config = config if config is not None else self.config
        if self.latent is None:
            capacity = self.max_cache_len or GROW * math.ceil(num_tokens / GROW)
            self._check_capacity(num_tokens, capacity)
            try:
                self.latent = LatentCache.from_config(config, batch_size, capacity, dtype=dtype, device=device,
                                                      kv_format=self.kv_format, policy=self.policy)
            except ValueError as e:  # a capacity past memory is the user's max_cache_len (as the static cache says)
                name, _, rest = str(e).partition(": ")
                if name != "capacity" or self.max_cache_len is None:
                    raise
                raise ValueError(f"max_cache_len: {rest}") from None
            self.stored = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
            self.device, self.is_initialized = self.latent.device, True
            return self.latent
        latent = self.latent
        held = (latent.kv_lora_rank, latent.qk_rope_head_dim, latent.num_kv_groups)
        writes = (config.kv_lora_rank, config.qk_rope_head_dim, config.num_key_scalars)
        if held != writes:
            raise ValueError(f"cache: it holds rows of another shape (kv_lora_rank, qk_rope_head_dim, key scalars "
                             f"per token) = {held} than this layer writes, {writes}: "
                             f"filled by another model, or before apply_latent_attention added a QK norm (whose keys "
                             f"need a scalar per token); pass a new cache, or call cache.reset() first")
        self.check_batch(batch_size)
        if self.offloading or self.is_offloaded:
            self.prefetch()
        if torch.device(device) != latent.device or dtype != latent.dtype:
            raise ValueError(f"cache: it holds {latent.dtype} rows on {latent.device}, the model now runs "
                             f"{dtype} on {device}; pass a new cache")
        needed = latent.max_len + num_tokens
        if needed > latent.capacity:
            self._check_capacity(needed, self.max_cache_len or needed)
            latent.grow(GROW * math.ceil(max(needed, 2 * latent.capacity) / GROW))
        return latent

    def check_batch(self, batch_size: int) -> None:
        """Refuse a batch of another size than the one this cache holds."""
        if self.latent is not None and batch_size != self.latent.batch_size:
            raise ValueError(f"cache: it holds {self.latent.batch_size} sequences and this input has {batch_size}; a "
                             f"cache serves one batch (pass a new cache, or call cache.reset() first)")

    def _check_capacity(self, needed: int, capacity: int) -> None:
        if needed > capacity:
            # "the prompt and new tokens need N" named this step's count, one of many still to come: a cap of N
            # failed again at the next step
            raise ValueError(f"max_cache_len: this cache holds {capacity} tokens per sequence, and with this step's "
                             f"it would hold {needed}; build it with a max_cache_len of at least the prompt's length "
                             f"plus the new tokens (less the last), or None to grow")

    def advance(self, valid: Optional[torch.Tensor], batch_size: int, num_tokens: int) -> None:
        """The attention layer's last call of a forward: count this forward's columns (``valid``
        [B, T], or None when all were real), then offload the rows if the cache offloads."""
        if valid is None:
            valid = torch.ones(batch_size, num_tokens, dtype=torch.bool, device=self.stored.device)
        self.stored = torch.cat((self.stored, valid.to(self.stored.device)), dim=1)
        self.columns += num_tokens
        if self.offloading:
            self.offload()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies in this layer (0 before the first forward)."""
        return self.latent.bytes_per_token if self.latent is not None else 0


QUANTIZED_INSTEAD = ("which quantizes keys and values; qkmla's attention caches latent rows, quantized with "
                     "apply_latent_attention(model, kv_format=\"fp8\", \"int8\" or \"int4\") or "
                     "LatentAttentionCache(model, kv_format=...)")


def check_cache(cache, name: str = "cache") -> None:
    """Refuse, changing nothing, a ``cache`` whose layers qkmla's attention cannot use: anything
    but a transformers ``Cache`` whose layers are latent ones or empty ``DynamicLayer`` s (which
    :func:`adopt_layer` turns into latent ones). ``name`` is the argument it came as."""
    if not isinstance(cache, Cache):
        raise ValueError(f"{name}: expected a transformers Cache (qkmla.integrations.transformers.LatentAttentionCache, "
                         f"or an empty DynamicCache), got {type(cache).__name__}")
    for layer_idx, layer in enumerate(cache.layers):
        _check_layer(layer, layer_idx, name, static_ok=not getattr(cache, "offloading", False))


def _check_layer(layer, layer_idx: int, name: str, static_ok: bool = True) -> None:
    if isinstance(layer, (LatentCacheLayer, StaticLatentCacheLayer)):
        return
    if LinearAttentionCacheLayerMixin and isinstance(layer, LinearAttentionCacheLayerMixin) \
            and not isinstance(layer, CacheLayerMixin):  # a hybrid's linear-attention state: transformers' own
        return
    kind = type(layer).__name__
    if isinstance(layer, StaticLayer):
        if "Indexed" in kind:  # transformers' static cache for a sparse attention model (DeepSeek-V3.2)
            raise ValueError(f"cache_implementation: layer {layer_idx} of the {name} is a transformers {kind} (the "
                             f"static cache of a sparse attention model); qkmla decodes sparse attention over the "
                             f"growing latent cache, whose layers keep the indexer's keys. Use the default cache")
        if type(layer) is not StaticLayer:
            raise ValueError(f"cache_implementation: layer {layer_idx} of the {name} is a transformers {kind}, which "
                             f"qkmla's latent attention cannot replace (DeepSeek models attend over every token); "
                             f"use cache_implementation=\"static\" or "
                             f"{name}=qkmla.integrations.transformers.LatentAttentionCache(model, max_cache_len=N, "
                             f"static=True)")
        if not static_ok:
            raise ValueError(f"cache_implementation: the {name} is an offloading static cache "
                             f"(cache_implementation=\"offloaded_static\"); qkmla's static latent cache keeps its "
                             f"fixed buffers on the model's device. Use cache_implementation=\"static\" (compileable) "
                             f"or \"offloaded\" (a growing latent cache offloaded layer by layer)")
        if int(layer.get_seq_length()) > 0:
            raise ValueError(f"{name}: layer {layer_idx} already holds {int(layer.get_seq_length())} tokens of "
                             f"transformers' keys and values ({FILLED_BY}); start from an empty cache")
        return
    if "Quantized" in kind:
        raise ValueError(f"cache_implementation: layer {layer_idx} of the {name} is a transformers {kind} "
                         f"(cache_implementation=\"quantized\"), {QUANTIZED_INSTEAD}")
    if type(layer) not in _DYNAMIC_LAYERS:
        raise ValueError(f"{name}: layer {layer_idx} is a transformers {kind}, which stores keys and values; "
                         f"qkmla's attention needs latent rows: pass "
                         f"qkmla.integrations.transformers.LatentAttentionCache(model, max_cache_len=...) for a fixed "
                         f"capacity, or an empty DynamicCache")
    if layer.get_seq_length() > 0:
        raise ValueError(f"{name}: layer {layer_idx} already holds {layer.get_seq_length()} tokens of transformers' "
                         f"keys and values ({FILLED_BY}); start from an empty cache")


# Who fills a transformers cache with keys and values before a patched model sees it. PEFT's prefix tuning did,
# and was told "filled by an unpatched model", which named neither it nor what to use instead.
PREFIX_TUNING = ("PEFT's prefix tuning (PrefixTuningConfig) passes its virtual tokens as per-head keys and values, "
                 "which qkmla's latent attention cannot attend to (it caches one latent row per token): prefix tuning "
                 "is not supported on a model patched by apply_latent_attention; fine-tune it with LoRA "
                 "(attention_lora_config) or prompt tuning (PromptTuningConfig)")
FILLED_BY = f"filled by an unpatched model, or by PEFT's prefix tuning: {PREFIX_TUNING}"


def adopt_layer(cache: Cache, layer_idx: int, config: MLAConfig, kv_format: str = "dense",
                policy: Optional[EvictionPolicy] = None):
    """``cache``'s latent layer ``layer_idx``; an empty transformers ``DynamicLayer`` in that slot
    (or none yet) becomes a :class:`LatentCacheLayer`, offloading if the cache offloads
    (``cache_implementation="offloaded"``), and an empty transformers ``StaticLayer``
    (``cache_implementation="static"``) a :class:`~.static.StaticLatentCacheLayer` of its
    ``max_cache_len``. Anything else is refused (:func:`check_cache`)."""
    if not isinstance(cache, Cache):
        check_cache(cache)
    layers = cache.layers
    if layer_idx < len(layers) and isinstance(layers[layer_idx], (LatentCacheLayer, StaticLatentCacheLayer)):
        return layers[layer_idx]
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    offloading = getattr(cache, "offloading", False)
    _check_layer(layers[layer_idx], layer_idx, "cache", static_ok=not offloading)
    if isinstance(layers[layer_idx], StaticLayer):
        check_static_settings(kv_format, policy, layers[layer_idx].max_cache_len)
        layers[layer_idx] = StaticLatentCacheLayer(config, layers[layer_idx].max_cache_len)
    else:
        layers[layer_idx] = LatentCacheLayer(config, kv_format, policy, offloading=offloading)
    return layers[layer_idx]


_MODEL_SETTING = object()  # "the model's setting", where None is a setting of its own


class LatentAttentionCache(FixedSettings, Cache):
    """A transformers ``Cache`` of qkmla latent layers for a model patched by ``apply_latent_attention``.

    Args:
        model: the patched model (``*ForCausalLM`` or ``*Model``).
        kv_format: the latent's storage; by default the one ``apply_latent_attention`` was given.
        policy: the eviction policy; by default the one ``apply_latent_attention`` was given
            (``policy=None`` turns eviction off).
        max_cache_len: a fixed capacity per sequence (transformers' static cache), or None to grow.
        offloading: keep each layer's rows in CPU memory between its forwards (transformers'
            ``offloaded`` cache, which ``generate(..., cache_implementation="offloaded")`` gets
            without building one).
        static: fixed buffers of ``max_cache_len`` columns written in place, which transformers
            compiles a decode step over (``StaticLatentCacheLayer``; what
            ``generate(..., cache_implementation="static")`` gets without building one); dense
            rows, no eviction policy, no offloading.

    Examples:
        >>> cache = LatentAttentionCache(model, kv_format="fp8")               # doctest: +SKIP
        >>> out = model.generate(input_ids, cache=cache, max_new_tokens=32)    # doctest: +SKIP

        (``cache=`` is transformers 5.24's name; earlier releases take it as ``past_key_values=``,
        which 5.24 still takes with a deprecation warning.)
        >>> static = LatentAttentionCache(model, max_cache_len=4096, static=True)  # doctest: +SKIP
    """

    # Read by nothing after construction: the layers were built from them (utils.checked.FixedSettings)
    fixed_settings = ("kv_format", "policy", "max_cache_len", "static", "offloading")

    def __init__(self, model, *, kv_format: Optional[str] = None, policy=_MODEL_SETTING, max_cache_len: Optional[int] = None,
                 offloading: bool = False, static: bool = False):
        settings = model_settings(model)
        slots = cache_slots(model)  # per cache layer: a latent attention, or None (transformers' own layer)
        kv_format = kv_format if kv_format is not None else settings.kv_format
        policy = settings.policy if policy is _MODEL_SETTING else policy
        # A NumPy int is a capacity, as LatentCache's: np.int64(4096) was refused as "expected a positive int ...,
        # got np.int64(4096)"
        max_cache_len = as_int(max_cache_len)
        # offloading="no" is truthy: it was taken as True, a cache moved to the CPU between forwards unasked
        check_bool("static", static)
        check_bool("offloading", offloading)
        if static and None in slots:
            raise ValueError("static: this model is a hybrid (linear-attention layers beside its MLA layers), "
                             "whose static cache qkmla does not build; use the growing cache (static=False)")
        if static:
            check_static_settings(kv_format, policy, max_cache_len)
            if offloading:
                raise ValueError("offloading: a static latent cache keeps its fixed buffers on the model's device; "
                                 "pass offloading=False, or static=False for an offloaded growing cache")
            super().__init__(layers=[StaticLatentCacheLayer(attn.config, max_cache_len) for attn in slots])
            return
        check_cache_settings(kv_format, policy, max_cache_len, model_dtype(model))
        own = _transformers_layers(model) if None in slots else None
        super().__init__(layers=[LatentCacheLayer(attn.config, kv_format, policy, max_cache_len, offloading)
                                 if attn is not None else own[i] for i, attn in enumerate(slots)],
                         offloading=offloading)

    def release_writer(self) -> None:
        """Forget which attention layers wrote the rows, in every layer (``LatentCache.release_writer``): the next
        model that writes takes them over, as when a prefix cache saved with one model is continued by the same
        weights loaded into another. The refusal of a cache handed to another model's layers names this method,
        which the cache a transformers model holds did not have (AttributeError)."""
        for layer in self.layers:
            if isinstance(getattr(layer, "latent", None), LatentCache):
                layer.latent.release_writer()
            elif isinstance(layer, StaticLatentCacheLayer):
                layer.writer = None
            else:
                continue
            # and the layer its transformers view expands keys with: the next writer's (review 15: a dead model's
            # reference was never replaced, so layer.keys stayed None for good after a rebuilt model took over)
            layer.attention = None

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies, summed over the latent layers (0 before the first forward;
        a hybrid's linear-attention state does not grow with the tokens)."""
        return sum(getattr(layer, "bytes_per_token", 0) for layer in self.layers)


def _transformers_layers(model) -> list:
    """The layers transformers' own ``DynamicCache`` makes for the model (a hybrid's linear-attention state)."""
    from transformers import DynamicCache

    return DynamicCache(config=inner_model(model).config).layers
