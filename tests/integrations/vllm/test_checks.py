"""What the vLLM plugin refuses to serve, and the message that names why (no vLLM needed)."""

from __future__ import annotations

import pytest

from qkmla.integrations.vllm.checks import servable_norm

CONFIG = dict(model_type="deepseek_v3", num_attention_heads=4, kv_lora_rank=512, qk_nope_head_dim=16,
              qk_rope_head_dim=64, qkmla={"qk_norm": "rms", "qk_norm_mode": "blockwise"})
OK = dict(platform="cpu", kv_cache_dtype="auto", quantization=None, chunked_prefill=False, prefix_caching=False)


def test_a_recorded_norm_is_returned_with_its_defaults_filled_in():
    norm = servable_norm(CONFIG, **OK)
    assert norm.kind == "rms" and norm.p == 2.0 and norm.learnable_logit_scale is False


def test_a_plain_checkpoint_is_not_checked_further():
    plain = {k: v for k, v in CONFIG.items() if k != "qkmla"}
    assert servable_norm(plain, **{**OK, "platform": "tpu", "kv_cache_dtype": "fp8", "chunked_prefill": True}) is None


@pytest.mark.parametrize("setting, value, message", [
    ("platform", "tpu", "platform: qkmla's vLLM backend serves"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype: qkmla's vLLM backend serves"),
    ("quantization", "fp8", "quantization: qkmla's vLLM backend serves"),
    ("decode_context_parallel_size", 2, "decode_context_parallel_size: qkmla's vLLM backend serves"),
    ("prefill_context_parallel_size", 2, "prefill_context_parallel_size: qkmla's vLLM backend serves"),
    ("mla_disabled", True, "VLLM_MLA_DISABLE: qkmla's vLLM backend serves .* unset it"),
    ("attention_backend", "FLASHMLA", "attention_backend: qkmla's vLLM backend serves .* on cpu with "
                                      "--attention-backend QKMLA_CPU, CPU_MLA, AMX_MLA .* got 'FLASHMLA'"),
    ("speculative", True, "speculative_config: qkmla's vLLM backend does not serve"),
    ("lora", True, "enable_lora: qkmla's vLLM backend does not serve"),
])
def test_each_engine_setting_the_backend_cannot_serve_is_refused_by_name(setting, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        servable_norm(CONFIG, **{**OK, setting: value})


@pytest.mark.parametrize("setting, name", [("chunked_prefill", "enable_chunked_prefill"),
                                           ("prefix_caching", "enable_prefix_caching")])
def test_cached_context_in_a_prefill_on_cuda_is_refused_where_vllms_gather_cannot_serve_it(setting, name):
    """On the CPU the context's rows come with their scalars (the wide workspace); on CUDA vLLM's
    gather fills rows of 320 or 576 values and each scalar is recomputed from its content key (both
    tested in test_engine.py, CUDA's gather emulated): refused for a unified norm or another latent
    width. Rows of any head count are served (padded to a multiple of 8 values on CUDA)."""
    heads16 = {**CONFIG, "num_attention_heads": 16}  # 576 + 16 scalars: 592 values a row
    unified = {**heads16, "qkmla": {"qk_norm": "rms", "qk_norm_mode": "unified"}}
    content = {**heads16, "qkmla": {"qk_norm": "l2", "qk_norm_mode": "content"}}
    scale_only = {**CONFIG, "qkmla": {"learnable_logit_scale": True}}  # plain MLA's 576-value row
    width_512 = {**heads16, "kv_lora_rank": 448}
    cuda = {**OK, "platform": "cuda", "dtype": "bfloat16", setting: True}
    for config in (CONFIG, unified, content, scale_only, width_512):
        assert servable_norm(config, **{**OK, setting: True})
    for config in (CONFIG, heads16, content, scale_only):  # 576 + 4 scalars: padded to 584 on CUDA
        assert servable_norm(config, **cuda)
    flag = "--no-" + name.replace("_", "-")
    for config, message in [
            (unified, "mode='unified' does not allow"),
            (width_512, "rows of 320 or 576 values, and config.json's kv_lora_rank \\+ qk_rope_head_dim is 512")]:
        with pytest.raises(ValueError, match=f"{name}: on CUDA .*{message}.*{flag}"):
            servable_norm(config, **cuda)


def test_on_cuda_float32_is_refused_and_cuda_graphs_are_not():
    """CUDA graphs are allowed: the cache write and the decode's launch read nothing from the device
    (``test_backend.py``, ``test_cuda_decode.py``)."""
    with pytest.raises(ValueError, match="dtype: on CUDA"):
        servable_norm(CONFIG, **{**OK, "platform": "cuda", "dtype": "float32"})
    assert servable_norm(CONFIG, **{**OK, "platform": "cuda", "dtype": "bfloat16"}).kind == "rms"


@pytest.mark.parametrize("platform, dtype, honoured, refused", [
    ("cpu", "float32", ["QKMLA_CPU", "CPU_MLA", "AMX_MLA", None], ["TRITON_MLA", "FLASHMLA", "QKMLA_TRITON"]),
    ("cuda", "bfloat16", ["QKMLA_TRITON", "TRITON_MLA", None],
     ["FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "QKMLA_CPU"]),
])
def test_the_attention_backend_asked_for_is_honoured_or_refused_by_name(platform, dtype, honoured, refused):
    """qkmla's backend is vLLM's CPU_MLA (CPU) or TRITON_MLA (CUDA) with qkmla's impl: asked for by
    its own name or its base's it serves, any other MLA backend (which caches no key scalars) is
    refused naming the setting and what it takes; a plain checkpoint is vLLM's business."""
    setting = {**OK, "platform": platform, "dtype": dtype}
    for name in honoured:
        assert servable_norm(CONFIG, **setting, attention_backend=name).kind == "rms"
    for name in refused:
        with pytest.raises(ValueError, match=f"attention_backend: .* got '{name}'"):
            servable_norm(CONFIG, **setting, attention_backend=name)
    plain = {k: v for k, v in CONFIG.items() if k != "qkmla"}
    assert servable_norm(plain, **setting, attention_backend=refused[0]) is None


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"rope_parameters": {**YARN, "mscale_all_dim": 1.0}}, "gives mscale_all_dim without mscale"),
    ({"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.2}}, "attention_factor"),
    # a GQA conversion's record without a norm is checked too: vLLM would serve it as a plain model
    ({"attention_bias": True, "qkmla": {"num_kv_groups": 2}}, "attention_bias=True"),
])
def test_what_vllms_deepseek_classes_would_read_differently_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        servable_norm({**CONFIG, **change}, **OK)


def test_yarn_with_both_mscales_is_served():
    assert servable_norm({**CONFIG, "rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}}, **OK)


@pytest.mark.parametrize("change, message", [
    ({"kv_lora_rank": 32}, r"kv_lora_rank \+ qk_rope_head_dim = 96"),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim > 0"),
    ({"model_type": "deepseek"}, "model_type='deepseek'"),
    ({"index_topk": 2048}, "index_topk"),
    ({"llama_4_scaling": {"beta": 0.1}}, "llama_4_scaling"),
    ({"qkmla": {"qk_norm": "rms", "qk_norm_mode": "sideways"}}, "config.json: its 'qkmla' entry is not valid"),
    ({"qkmla": {"qk_norm": "rms", "num_kv_groups": 3}}, "num_kv_groups=3"),
    ({"qkmla": {"qk_norm": "rms", "qk_norm_scope": "projection"}}, "scope='projection': qkmla's vLLM"),
])
def test_a_layout_the_backend_cannot_serve_is_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        servable_norm({**CONFIG, **change}, **OK)
