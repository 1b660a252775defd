import pytest
import torch

L0 = 32  # YaRN's original context in the saved checkpoint's config
CONFIG = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=4 * L0, attn_implementation="eager",
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=L0, mscale=0.707,
                         mscale_all_dim=1.0, rope_theta=100.0),
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, float64 model): a tiny random DeepseekV3ForCausalLM saved in many safetensors shards."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." in name:  # logits of a few units and norms away from ones
                p.add_(0.05 * torch.randn_like(p)) if p.dim() == 1 else p.mul_(10.0)
    path = tmp_path_factory.mktemp("ds3")
    model.save_pretrained(path, max_shard_size="60KB")
    model.set_experts_implementation("eager")  # the default grouped_mm has no float64
    return path, model.double().eval()


def _attention_io(model, ids):
    """{layer: (attention input hidden states, attention output)} from one transformers forward."""
    io = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda mod, args, kwargs, out, i=i: io.__setitem__(i, (kwargs["hidden_states"], out[0])), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return io


@pytest.fixture
def attention_io():
    """attention_io(model, ids) -> {layer: (attention input, attention output)} of a transformers model."""
    return _attention_io
