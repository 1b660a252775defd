"""torchtitan DeepSeek-V3 <-> Hugging Face checkpoints (``integrations.torchtitan.checkpoint``): an exported
model computes the same logits in transformers (qkmla's loader for a QK-normed one) and decodes the same
greedy tokens through qkmla's latent cache; an import gives back every parameter bit for bit; what
transformers cannot compute the same way, and checkpoints that do not fit the model, are refused."""

import dataclasses
import json
import os
from functools import partial

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402
from torchtitan.config import derive  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import get_causal_mask_mod  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers  # noqa: E402

from qkmla import QKNormConfig  # noqa: E402
from qkmla.integrations.hub.checkpoint import SINGLE  # noqa: E402
from qkmla.integrations.torchtitan.attention import QKAttention  # noqa: E402
from qkmla.integrations.torchtitan.checkpoint import export_hf, import_hf  # noqa: E402
from qkmla.integrations.torchtitan.flavors import materialize  # noqa: E402
from qkmla.integrations.torchtitan.inner import DenseMaskAttention  # noqa: E402

VOCAB, DIM, T = 128, 64, 12
NORMS = {"rms-blockwise": QKNormConfig(), "rms-unified": QKNormConfig("rms", "unified"),
         "l2-learned-scale": QKNormConfig("l2", learnable_logit_scale=True), "lp3": QKNormConfig("lp", p=3.0),
         "plain": None}


class Float32Experts(GroupedExperts):
    """torchtitan's grouped experts in the parameters' dtype (its own forward casts to bfloat16): the same
    function and parameters, so that logits compare at float32 rounding."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD, num_tokens_per_expert_E):
        """x [R, dim], tokens per expert [E] -> [R, dim]."""
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        mm = partial(torch._grouped_mm, offs=offsets)
        h = nn.functional.silu(mm(x_RD, self.w1_EFD.transpose(-2, -1))) * mm(x_RD, self.w3_EFD.transpose(-2, -1))
        return mm(h, self.w2_EDF.transpose(-2, -1))


def build(norm=None, *, q_lora_rank=0, score_func="sigmoid", latent_eps=1e-6, groups=(2, 1), seed=0,
          n_layers=3, kv_lora_rank=32, rope_dim=8, vocab=VOCAB):
    """A torchtitan DeepSeek-V3 (one dense layer, then MoE with HF's routing), float32 on the CPU, random
    weights with norms away from ones and a nonzero expert bias."""
    init = {"weight": partial(nn.init.normal_, std=0.1)}
    layers = build_mla_moe_layers(
        n_layers=n_layers, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.7, dense_hidden_dim=96,
        moe_hidden_dim=32,
        num_experts=4, num_shared_experts=2, router_top_k=2, router_score_func=score_func,
        router_num_expert_groups=groups[0], router_num_limited_groups=groups[1], router_route_scale=2.5,
        router_route_norm=True, attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        linear_init=init, norm_init={"weight": nn.init.ones_}, depth_init=lambda i: init,
        depth_experts_init=lambda i: {w: partial(nn.init.normal_, std=0.1) for w in ("w1_EFD", "w2_EDF", "w3_EFD")},
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=256, theta=10000.0, scaling="yarn", rope_factor=4.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=64))
    for layer in layers:
        a = layer.attention
        latent = dict(kv_norm=dataclasses.replace(a.kv_norm, eps=latent_eps),
                      q_norm=dataclasses.replace(a.q_norm, eps=latent_eps),
                      inner_attention=derive(a.inner_attention, DenseMaskAttention.Config))
        layer.attention = derive(a, QKAttention.Config, qk_norm=norm, **latent) if norm is not None \
            else dataclasses.replace(a, **latent)
        if layer.moe is not None:
            layer.moe.routed_experts.inner_experts = derive(layer.moe.routed_experts.inner_experts,
                                                            Float32Experts.Config)
    config = DeepSeekV3Model.Config(
        vocab_size=vocab, dim=DIM, layers=layers, norm=RMSNorm.Config(normalized_shape=DIM),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=DIM,
                                        param_init={"weight": nn.init.normal_}),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab, param_init=init))
    model = materialize(config, "cpu", seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("logit_scale"):  # norm weights, logit scales: not ones
                p.mul_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias_E"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


def tt_logits(model, tokens):
    """torchtitan's logits [B, T, V] at positions 0..T-1 (one document: the causal mask the model builds, made
    without ``get_attention_masks``' torch.compile, which recompiles for every length)."""
    B, L = tokens.shape
    positions = torch.arange(L).expand(B, -1)
    mask = create_block_mask(get_causal_mask_mod(), B, None, L, L, device="cpu")
    with torch.no_grad():
        return model(tokens, positions=positions, attention_masks=mask)


def loaded(path, norm):
    """The exported directory in transformers: [transformers' Auto class, qkmla's loader] (with qkmla's
    transformers integration imported, the Auto class loads a QK-normed checkpoint as qkmla's architecture;
    qkmla's loader computes with its latent cache)."""
    from transformers import AutoModelForCausalLM

    from qkmla.integrations.transformers import from_pretrained

    # transformers' Auto class: the stock model for a plain checkpoint, qkmla's architecture for a QK-normed one
    auto = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [auto, from_pretrained(path, dtype=torch.float32)]


@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["q-lora-0", "q-lora-24"])
@pytest.mark.parametrize("name", list(NORMS))
def test_exported_model_computes_the_same_logits_and_greedy_tokens(tmp_path, name, q_lora_rank):
    norm = NORMS[name]
    model = build(norm, q_lora_rank=q_lora_rank)
    path = export_hf(model, tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    assert config["q_lora_rank"] == (q_lora_rank or None)
    assert ("qkmla" in config) == (norm is not None) == (path / "modeling_qkmla.py").is_file()
    assert (config["model_type"], config["architectures"]) == (("deepseek_v3", ["DeepseekV3ForCausalLM"]) if norm is None
                                                               else ("qkmla_deepseek_v3", ["QKNormDeepseekV3ForCausalLM"]))

    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    want = tt_logits(model, tokens)
    for hf in loaded(path, norm):
        with torch.no_grad():
            got = hf(tokens).logits
        print(f"{name} q_lora_rank={q_lora_rank} {type(hf.model.layers[0].self_attn).__name__}: max |logit "
              f"difference| = {(got - want).abs().max().item():.3g} (logits up to {want.abs().max().item():.3g})")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    prompt, new = tokens[:, :4], 6  # hf: qkmla's latent cache, whose decode steps take the absorbed path
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    seq = prompt
    for _ in range(new):  # torchtitan's forward re-run on the growing sequence
        seq = torch.cat([seq, tt_logits(model, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("name", ["rms-blockwise", "l2-learned-scale", "plain"])
def test_import_of_an_export_gives_every_parameter_bit_for_bit(tmp_path, name):
    model = build(NORMS[name], q_lora_rank=24)
    path = export_hf(model, tmp_path / "hf")
    fresh = build(NORMS[name], q_lora_rank=24, seed=1)
    import_hf(path, fresh)
    want, got = model.state_dict(), fresh.state_dict()
    assert set(want) == set(got)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def test_an_existing_out_dir_is_refused_unless_overwrite(tmp_path):
    model = build()
    export_hf(model, tmp_path / "hf")  # an empty directory is written into, as qkmla convert's --out
    with pytest.raises(ValueError, match="out_dir: .* exists and is not empty; pass overwrite=True"):
        export_hf(model, tmp_path / "hf")
    export_hf(model, tmp_path / "hf", overwrite=True)
    assert (tmp_path / "hf" / SINGLE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left
    umask = os.umask(0)
    os.umask(umask)  # a test's own process: nothing else creates files meanwhile
    # mkdtemp's 0700 and safetensors' 0600 made an export readable by its owner alone
    assert os.stat(tmp_path / "hf" / SINGLE).st_mode & 0o777 == 0o666 & ~umask
    assert os.stat(tmp_path / "hf").st_mode & 0o777 == 0o777 & ~umask


def test_overwrite_given_as_a_string_is_refused(tmp_path):
    """Probe 10b (t09): export_hf(model, out_dir, overwrite="no") is truthy, and replaced the checkpoint already
    in out_dir without a word. Refused naming overwrite, before anything is written."""
    model = build()
    export_hf(model, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    (tmp_path / "hf.tmp999999").mkdir()  # a dead export's temporary: a checked call would clear it first
    for value in ("no", 1, None):
        with pytest.raises(ValueError, match=f"^overwrite: expected True or False, got {value!r}$"):
            export_hf(model, tmp_path / "hf", overwrite=value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp999999"]  # refused before any work


@pytest.mark.parametrize("kwargs, match", [
    (dict(score_func="softmax"), r"layers\.1\.moe\.router\.score_func: .* allowed: 'sigmoid', got 'softmax'"),
    (dict(latent_eps=1e-5), r"layers\.0\.attention\.kv_norm\.eps: .* allowed: 1e-06, got 1e-05"),
])
def test_a_model_transformers_computes_otherwise_is_refused_before_writing(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_hf(build(**kwargs), tmp_path / "hf")
    assert not list(tmp_path.iterdir())


def test_layers_of_mixed_attention_kinds_are_refused(tmp_path):
    model = build(QKNormConfig())
    model.config.layers[2].attention = dataclasses.replace(model.config.layers[1].attention, qk_norm=None)
    with pytest.raises(ValueError, match=r"mixed attention kinds: layers\.2\.attention has no QK norm"):
        export_hf(model, tmp_path / "hf")


@pytest.mark.parametrize("saved, target", [("rms-blockwise", "plain"), ("plain", "rms-blockwise"),
                                           ("rms-blockwise", "rms-unified")])
def test_import_into_a_model_of_another_norm_is_refused(tmp_path, saved, target):
    path = export_hf(build(NORMS[saved]), tmp_path / "hf")
    fresh = build(NORMS[target], seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"records .* but model's attention layers have"):
        import_hf(path, fresh)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_a_checkpoint_whose_record_and_tensors_disagree_is_refused_before_reading_weights(tmp_path, monkeypatch):
    path = export_hf(build(NORMS["rms-blockwise"]), tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    del config["qkmla"], config["attn_implementation"]  # the record gone, the norm tensors still there
    (path / "config.json").write_text(json.dumps(config))
    import safetensors

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(safetensors.safe_open, "get_tensor", no_reading, raising=False)
    with pytest.raises(ValueError, match="model_type 'qkmla_deepseek_v3' is a QK-normed checkpoint's, but .* records "
                                         "no QK norm"):
        import_hf(path, build(None))
    config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])  # declared stock as well
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds QK-norm weights .* records no norm"):
        import_hf(path, build(None))


def test_overwrite_replaces_only_a_checkpoint_directory(tmp_path):
    """Probe 9b (H03, H14-H16): export_hf(..., overwrite=True) replaced whatever out_dir named, whole: a
    user's file (now a directory), a directory of notes, a qkmla training run, and out_dir='' was the
    working directory. Each is refused now, naming out_dir, and left as it was."""
    model = build()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"train": {}}')  # a training run's config: no model_type
    (run / "checkpoint.safetensors").write_bytes(b"x")
    (tmp_path / "file").write_text("keep")
    cases = [(tmp_path / "file", "is a file"), (notes, "holds no transformers config.json"),
             (run, "holds no transformers config.json"), ("", "expected the path of the checkpoint directory"),
             (tmp_path / ("x" * 300), "cannot use the checkpoint directory")]
    for out, why in cases:
        with pytest.raises(ValueError, match=f"out_dir: .*{why}"):
            export_hf(model, out, overwrite=True)
    assert (tmp_path / "file").read_text() == "keep" and (notes / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.safetensors", "config.json"]
    path = export_hf(model, tmp_path / "hf")
    (path / "README.md").write_text("mine")  # a checkpoint holding a file the export does not write
    with pytest.raises(ValueError, match="out_dir: .*holds README.md, which this export does not write"):
        export_hf(model, path, overwrite=True)
    with pytest.raises(ValueError, match="out_dir: .* is the checkpoint being exported"):
        export_hf(model, path / "sub", source=path)
    # A conversion copies its source's files, so their names are its own; an export copies none of the
    # DCP step directory's: a file named as one of them is the user's (review of 9b's check, shared with convert)
    (path / "README.md").unlink()
    step = tmp_path / "step-10"
    step.mkdir()
    (step / ".metadata").write_bytes(b"dcp")
    (path / ".metadata").write_text("mine")
    with pytest.raises(ValueError, match="out_dir: .*holds .metadata, which this export does not write"):
        export_hf(model, path, overwrite=True, source=step)


def test_a_non_utf8_out_dir_is_refused_before_writing(tmp_path):
    """Probe 11b (tt11): export_hf(model, b"bad\\xfe" as a str) wrote the whole checkpoint under a name
    that is not UTF-8, which every reader of it then refused (from_pretrained, import_hf: safetensors and
    tokenizers take UTF-8 paths). Refused now naming out_dir, before anything is made, as convert's --out."""
    model = build()
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xfe")
    with pytest.raises(ValueError, match="^out_dir: .* is not a UTF-8 path"):
        export_hf(model, out)
    assert sorted(os.listdir(tmp_path)) == []
    assert (export_hf(model, tmp_path / "hf") / "config.json").is_file()  # a UTF-8 name is written as before


def test_an_out_dir_written_by_another_command_during_the_export_is_left_alone(tmp_path, monkeypatch):
    """As qkmla convert (probe 9, cx01): ``qkmla train --out`` the same name while the export works
    made a run there, which the export's final rename moved aside and deleted. The export is refused
    at the rename now, naming out_dir, and the run is kept."""
    import safetensors.torch

    model = build()
    out = tmp_path / "hf"
    real = safetensors.torch.save_file

    def save_while_another_writes(tensors, filename, metadata=None):
        out.mkdir()
        (out / "status.json").write_text('{"status": "running"}')  # another command's output, made meanwhile
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_while_another_writes)
    with pytest.raises(ValueError, match="out_dir: .*hf changed while this command worked"):
        export_hf(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["status.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left


def test_export_command_refuses_its_own_checkpoint_and_a_corrupt_one(tmp_path, capsys):
    """Probe 9b (H13): the export command read a truncated DCP .metadata into a bare UnpicklingError
    traceback; and with --overwrite its out_dir could be the step directory it reads (replaced by the
    export). Both are one line, exit 2, the step directory untouched."""
    from qkmla.integrations.torchtitan import export

    step = tmp_path / "step-1"
    step.mkdir()
    (step / ".metadata").write_bytes(b"x")
    (step / "__0_0.distcp").write_bytes(b"y")
    args = ["--", "--module", "qkmla.integrations.torchtitan", "--config", "qkmla_cpu_qk_norm"]
    assert export.main([str(step), str(step), "--overwrite", *args]) == 2
    assert "out_dir: " in capsys.readouterr().err and (step / ".metadata").read_bytes() == b"x"
    assert export.main([str(step), str(tmp_path / "hf"), *args]) == 2
    err = capsys.readouterr().err
    assert "checkpoint: " in err and ".metadata is not a readable DCP" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()
