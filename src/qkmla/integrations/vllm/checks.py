"""What the vLLM plugin can serve, checked before vLLM builds a layer (no vLLM import here).

A checkpoint is served with its QK norm when its ``config.json`` holds a ``"qkmla"`` record
(``integrations.hub.record``); without one it is vLLM's own model. Everything the QK-normed path
does not do is refused here, naming the setting, rather than served wrong.
"""

from __future__ import annotations

from typing import Optional

from ...config import QKNormConfig
from ...utils.checked import is_int
from ..hub.record import RECORD, recorded_groups, recorded_norm

PLATFORMS = ("cpu", "cuda")
# The scalars ride in the row in the model's dtype. A quantized cache would also take vLLM's fp8
# context gather (cp_gather_cache), which copies whole source rows: past its workspace's width
# for a row with scalars and padding.
KV_CACHE_DTYPES = ("auto",)
LATENT_WIDTHS = (320, 512, 576)  # d_c + d_r: what vLLM 0.32's MLA metadata accepts (MLACommonBackend)
# --attention-backend values a QK-normed checkpoint is served with, by platform (None: vLLM's
# choice): qkmla's backends under their registered names, and the vLLM backends each is built on
# (on the CPU also AMX_MLA, whose configuration, 128-token blocks, qkmla's CPU backend serves).
ATTENTION_BACKENDS = {"cpu": (None, "QKMLA_CPU", "CPU_MLA", "AMX_MLA"), "cuda": (None, "QKMLA_TRITON", "TRITON_MLA")}


def servable_norm(hf_config, *, platform: str, kv_cache_dtype: str, quantization: Optional[str],
                  chunked_prefill: bool, prefix_caching: bool, decode_context_parallel_size: int = 1,
                  dtype: str = "float32", speculative: bool = False, lora: bool = False,
                  prefill_context_parallel_size: int = 1, mla_disabled: bool = False,
                  attention_backend: Optional[str] = None) -> Optional[QKNormConfig]:
    """The recorded QK norm of ``hf_config`` (None for a plain checkpoint), after checking that the
    plugin can serve it with these engine settings. ValueError naming the field otherwise."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    norm = recorded_norm(hf_config, where="config.json")
    groups = recorded_groups(hf_config, where="config.json")
    if groups is not None or norm is not None:
        _check_layout_vllm_reads(get)
    if norm is None:
        return None
    what = f"a QK-normed checkpoint (config.json's {RECORD!r} record)"
    if norm.scope != "head":
        raise ValueError(f"config.json: the QK norm's scope={norm.scope!r}: qkmla's vLLM backend serves a "
                         f"statistic per head and KV group (scope='head'); a statistic over the whole "
                         f"projection spans the heads a tensor-parallel rank splits")
    if platform not in PLATFORMS:
        raise ValueError(f"platform: qkmla's vLLM backend serves {what} on {PLATFORMS}, got {platform!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: qkmla's vLLM backend serves {what} with kv_cache_dtype in "
                         f"{KV_CACHE_DTYPES} (the key scalars ride in the cache row, in the model's dtype), "
                         f"got {kv_cache_dtype!r}")
    if quantization is not None:
        raise ValueError(f"quantization: qkmla's vLLM backend serves {what} with unquantized weights (it derives "
                         f"the key scalars from kv_b_proj.weight), got {quantization!r}")
    if mla_disabled:
        raise ValueError(f"VLLM_MLA_DISABLE: qkmla's vLLM backend serves {what} through vLLM's MLA (the latent "
                         f"cache with the key scalars), which VLLM_MLA_DISABLE=1 turns off; unset it")
    for name, size in (("decode_context_parallel_size", decode_context_parallel_size),
                       ("prefill_context_parallel_size", prefill_context_parallel_size)):
        if size != 1:
            raise ValueError(f"{name}: qkmla's vLLM backend serves {what} with {name}=1 (its cache write and "
                             f"prefill keys are written for one rank's whole sequence), got {size}")
    allowed = ATTENTION_BACKENDS.get(platform, (None,))
    if attention_backend not in allowed:
        names = ", ".join(a for a in allowed if a)
        raise ValueError(f"attention_backend: qkmla's vLLM backend serves {what} on {platform} with "
                         f"--attention-backend {names} (or none: vLLM's choice), got {attention_backend!r}; "
                         f"the other MLA backends cache no key scalars")
    for name, on in (("speculative_config", speculative), ("enable_lora", lora)):
        if on:
            raise ValueError(f"{name}: qkmla's vLLM backend does not serve {what} with {name} (the draft layers "
                             f"and LoRA adapters would run without the key scalars' W_UK)")
    if platform == "cuda":
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype: on CUDA qkmla's vLLM backend (vLLM's TRITON_MLA) serves float16 or bfloat16, "
                             f"got {dtype!r}")
    if get("model_type") == "deepseek" or not get("qk_rope_head_dim") or not get("qk_nope_head_dim"):
        raise ValueError(f"config.json: {what} must be an MLA model with a content and a RoPE block "
                         f"(qk_nope_head_dim, qk_rope_head_dim > 0), got model_type={get('model_type')!r}, "
                         f"qk_nope_head_dim={get('qk_nope_head_dim')!r}, qk_rope_head_dim={get('qk_rope_head_dim')!r}")
    # Read as truthy above: qk_nope_head_dim -3, 0.5 or True passed, and vLLM failed building the layer
    for field in ("qk_nope_head_dim", "v_head_dim", "num_attention_heads"):
        if (field == "qk_nope_head_dim" or get(field) is not None) and (not is_int(get(field)) or get(field) < 1):
            raise ValueError(f"config.json: {field} must be a positive int (a head's width, or the heads), got "
                             f"{get(field)!r}")
    for field in ("kv_lora_rank", "qk_rope_head_dim"):
        # 448.0 summed to a width of 512.0, which passed; True summed as 1; "abc" failed in the sum, a TypeError
        if not is_int(get(field)) or get(field) < 1:
            raise ValueError(f"config.json: {field} must be a positive int (the latent row's width is kv_lora_rank "
                             f"+ qk_rope_head_dim), got {get(field)!r}")
    if get("qk_rope_head_dim") % 2:  # 513 + 63 is a width vLLM takes (576): served, a layer qkmla's MLA refuses
        raise ValueError(f"config.json: qk_rope_head_dim must be even (RoPE rotates pairs), got "
                         f"{get('qk_rope_head_dim')!r}")
    width = get("kv_lora_rank") + get("qk_rope_head_dim")
    if width not in LATENT_WIDTHS:
        raise ValueError(f"config.json: kv_lora_rank + qk_rope_head_dim = {width}; vLLM's MLA serves latent rows of "
                         f"{LATENT_WIDTHS} values (DeepSeek-V2/V3: 512 + 64)")
    if platform != "cpu":
        _check_cuda_context_gather(norm, width, chunked_prefill, prefix_caching)
    for field in ("index_topk", "llama_4_scaling"):
        if get(field) is not None:
            raise ValueError(f"config.json: {field}: qkmla's vLLM backend does not serve {what} with "
                             f"{field} (sparse indexer, Llama-4 query scaling)")
    return norm


def _check_cuda_context_gather(norm: QKNormConfig, width: int, chunked_prefill: bool, prefix_caching: bool) -> None:
    """A prefill over cached context on CUDA reads it through vLLM's gather kernel
    (``gather_and_maybe_dequant_cache``): into a workspace of 320 or 576 values per row only, the
    first values of each cache row, loaded 16 bytes at a time (the CUDA backend pads each row to a
    multiple of 8 values for that: ``backend.cuda_backend``). The scalars stay behind and are
    recomputed from the content keys (``backend.py``), which a unified statistic does not allow:
    it reads the RoPE key before its weight and rotation."""
    for name, on, flag in (("enable_chunked_prefill", chunked_prefill, "--no-enable-chunked-prefill"),
                           ("enable_prefix_caching", prefix_caching, "--no-enable-prefix-caching")):
        if not on:
            continue
        off = f"start vLLM with {flag} ({name}=False)"
        if norm.kind is not None and norm.mode == "unified":
            raise ValueError(f"{name}: on CUDA qkmla's vLLM backend attends over cached context in a prefill "
                             f"(which {name} needs) by recomputing each context key's scalar from its content key, "
                             f"which a QK norm of mode='unified' does not allow (its statistic reads the RoPE key "
                             f"too); "
                             f"{off}, or serve on the CPU")
        if width not in (320, 576):
            raise ValueError(f"{name}: on CUDA vLLM gathers cached context into rows of 320 or 576 values, and "
                             f"config.json's kv_lora_rank + qk_rope_head_dim is {width}; {off}")


def _check_layout_vllm_reads(get) -> None:
    """Refuse what vLLM's DeepSeek classes would read differently from transformers: they build the
    projections without biases (and drop any bias a checkpoint holds), always rotate interleaved
    pairs, and read YaRN's mscale settings their own way."""
    if get("attention_bias"):
        raise ValueError("config.json: attention_bias=True: vLLM's DeepSeek classes have no attention biases and "
                         "would drop them (a GQA conversion, qkmla convert-gqa, writes them); not servable by vLLM")
    if get("rope_interleave", True) is False:
        raise ValueError("config.json: rope_interleave=False: vLLM's DeepSeek classes rotate interleaved pairs only "
                         "(a GQA conversion, qkmla convert-gqa, writes half-split RoPE); not servable by vLLM")
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if not isinstance(rope, dict):  # rope.get failed: "AttributeError: 'str' object has no attribute 'get'"
        field = "rope_parameters" if get("rope_parameters") else "rope_scaling"
        raise ValueError(f"config.json: {field} must be a JSON object (rope_type, rope_theta, ...), got "
                         f"{type(rope).__name__} {rope!r:.60}")
    if rope.get("rope_type", rope.get("type")) == "yarn":
        given = [k for k in ("mscale", "mscale_all_dim") if rope.get(k) is not None]
        if len(given) == 1:
            raise ValueError(f"config.json: rope_parameters gives {given[0]} without "
                             f"{({'mscale', 'mscale_all_dim'} - set(given)).pop()}: transformers and vLLM then scale "
                             f"YaRN's cos/sin differently; give both")
        for k in ("attention_factor", "truncate"):
            if rope.get(k) is not None:
                raise ValueError(f"config.json: rope_parameters.{k}: vLLM's DeepSeek YaRN ignores it, transformers "
                                 f"reads it; not servable by vLLM as recorded")
