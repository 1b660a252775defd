"""Conversion to QK-normed MLA: what a converted layer computes, the warm start, files on disk, `qkmla convert`."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from qkmla.cli import main  # noqa: E402
from qkmla.interop import load_converted, mla_from_hf, mla_layers_from_hf_dir, save_converted, warm_start_qk_norm  # noqa: E402
from qkmla.interop.convert import CONVERTED_CONFIG, _block_scores, _rms, plain_copy  # noqa: E402

T = 48


def logit_stats(mla, source, x, ref):
    """(RMS of mla's causal logits / source's, relative output error against ref) on x."""
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    with torch.no_grad():
        q, k, _ = mla.explicit_qkv(x, pos)
        qs, ks, _ = source.explicit_qkv(x, pos)
        ratio = _rms(_block_scores(q, k, mla.scale, 1)) / _rms(_block_scores(qs, ks, source.scale, 1))
        return ratio, float((mla(x) - ref).norm() / ref.norm())


def test_converted_layer_computes_normalized_logits(saved, attention_io):
    """With qk_norm="rms" and unit weights, logits are tau (RMSNorm(q^C).RMSNorm(k^C) + RoPE(RMSNorm(q^R))
    .RoPE(RMSNorm(k^R))), computed here from transformers' own modules: not the source function."""
    _, model = saved
    hf = model.model.layers[1].self_attn
    mla = mla_from_hf(hf, qk_norm="rms")
    x = attention_io(model, torch.randint(0, 100, (2, T)))[1][0]
    with torch.no_grad():
        q = hf.q_b_proj(hf.q_a_layernorm(hf.q_a_proj(x))).view(2, T, 4, 32).transpose(1, 2)
        q_c, q_r = q.split([16, 16], -1)
        c_kv, k_r = hf.kv_a_proj_with_mqa(x).split([32, 16], -1)
        k_c = hf.kv_b_proj(hf.kv_a_layernorm(c_kv)).view(2, T, 4, 32).transpose(1, 2)[..., :16]
        k_r = k_r.view(2, 1, T, 16)
        norm = lambda v: F.rms_norm(v, (v.shape[-1],), eps=1e-6)  # noqa: E731
        cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
        q_r, k_r = v3.apply_rotary_pos_emb_interleave(norm(q_r), norm(k_r), cos, sin)
        want = hf.scaling * (norm(q_c) @ norm(k_c).transpose(-1, -2) + q_r @ k_r.transpose(-1, -2))
        got = mla.logits(x)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        torch.testing.assert_close(got[..., causal], want[..., causal], rtol=1e-5, atol=1e-5)  # HF's float32 tables
        ratio, err = logit_stats(mla, plain_copy(mla), x, hf(x, position_embeddings=(cos, sin), attention_mask=None)[0])
    assert err > 0.1 and not 0.8 < ratio < 1.25  # the norm changed the function and the logits' scale


@pytest.mark.parametrize("qk_norm,mode", [("rms", "blockwise"), ("rms", "unified"), ("l2", "blockwise")])
def test_warm_start_matches_the_source_logit_scale(saved, qk_norm, mode, attention_io):
    path, model = saved
    cal, test = attention_io(model, torch.randint(0, 100, (4, T))), attention_io(model, torch.randint(0, 100, (4, T)))
    for i, mla in mla_layers_from_hf_dir(path, dtype=torch.float64, qk_norm=qk_norm, qk_norm_mode=mode).items():
        source = plain_copy(mla)
        unit_ratio, unit_err = logit_stats(mla, source, *test[i])
        report = warm_start_qk_norm(mla, source, cal[i][0])
        for block in ("content", "rope"):  # exact on the calibration batch, per block
            assert report[block]["rms_warm"] == pytest.approx(report[block]["rms_source"], rel=1e-10)
            assert torch.all(getattr(mla.q_norm, block).weight == report[block]["gamma_q"])
        ratio, err = logit_stats(mla, source, *test[i])
        assert 0.9 < ratio < 1.1 and not 0.8 < unit_ratio < 1.25, (ratio, unit_ratio)
        assert err < 0.9 * unit_err, (err, unit_err)  # closer to the source function, though not equal
        assert err > 0.05


def test_warm_start_bad_input(saved):
    path, _ = saved
    plain = mla_layers_from_hf_dir(path, 0)[0]
    with pytest.raises(ValueError, match="mla: has no QK norm"):
        warm_start_qk_norm(plain, plain, torch.randn(1, 4, 64))
    other = mla_from_hf(v3.DeepseekV3Attention(
        transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
                                      q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16), 0))
    with pytest.raises(ValueError, match="source: its shape"):
        warm_start_qk_norm(mla_layers_from_hf_dir(path, 0, qk_norm="rms")[0], other, torch.randn(1, 4, 64))


def test_save_and_load_converted(saved, tmp_path):
    path, _ = saved
    layers = mla_layers_from_hf_dir(path, [0, 2], qk_norm="rms")
    with torch.no_grad():
        layers[2].k_norm.rope.weight.fill_(0.5)
    save_converted(layers, tmp_path / "out", source=str(path))
    back = load_converted(tmp_path / "out")
    assert list(back) == [0, 2] and back[2].config == layers[2].config
    x = torch.randn(1, 9, 64)
    for i in back:
        torch.testing.assert_close(back[i](x), layers[i](x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="qkmla_config.json does not exist"):
        load_converted(tmp_path)
    meta = json.loads((tmp_path / "out" / CONVERTED_CONFIG).read_text())
    meta["mla_config"]["kv_lora_rank"] = 16
    (tmp_path / "out" / CONVERTED_CONFIG).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"model.safetensors: layer 0 does not match .*qkmla_config.json"):
        load_converted(tmp_path / "out")
    with pytest.raises(ValueError, match="layers: nothing to save"):
        save_converted({}, tmp_path / "empty")


def test_cli_convert(saved, tmp_path, capsys, refused, attention_io):
    path, model = saved
    assert main(["convert", str(path), "--out", str(tmp_path / "plain"), "--dtype", "float64"]) == 0
    plain = load_converted(tmp_path / "plain")
    io = attention_io(model, torch.randint(0, 100, (2, T)))
    with torch.no_grad():
        for i, mla in plain.items():  # qk_norm None: transformers' function, all layers
            assert float((mla(io[i][0]) - io[i][1]).abs().max() / io[i][1].abs().max()) < 5e-6

    assert main(["convert", str(path), "--out", str(tmp_path / "qk"), "--qk-norm", "rms", "--layer", "1",
                 "--warm-start"]) == 0
    assert "layer 1: content gamma_q" in capsys.readouterr().out
    qk = load_converted(tmp_path / "qk")
    assert list(qk) == [1] and qk[1].config.qk_norm == "rms" and qk[1].kv_b_proj.weight.dtype == torch.float32
    assert not torch.all(qk[1].q_norm.content.weight == 1)
    bad = str(tmp_path / "bad")
    refused(["convert", str(path), "--out", bad, "--layer", "3"], r"qkmla convert: layers: expected layer indices in \[0, 3\)")
    refused(["convert", str(path), "--out", bad, "--warm-start"], "qkmla convert: --warm-start: only meaningful with a QK norm")
    refused(["convert", str(tmp_path / "nowhere"), "--out", bad], "qkmla convert: hf_dir: .* is not a directory")
    assert not (tmp_path / "bad").exists()


def test_convert_never_writes_over_its_input_or_an_existing_conversion(saved, tmp_path, refused, capsys):
    """Issue 27, class 1: --out the source directory is refused, with --overwrite too (it replaced
    the source's weights before); an existing conversion needs --overwrite; --out a file, and
    --calibration-tokens beyond memory or without --warm-start, are refused before any work."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(saved[0], src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (src, src / ".." / "src"):
        refused(["convert", str(src), "--out", str(out), "--overwrite"], "--out: .* is the checkpoint being converted")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    out = tmp_path / "out"
    assert main(["convert", str(src), "--out", str(out), "--layer", "0"]) == 0
    first = (out / "model.safetensors").read_bytes()
    refused(["convert", str(src), "--out", str(out), "--layer", "1"],
            r"--out: .*model.safetensors, .*qkmla_config.json already exist; pass --overwrite to replace them")
    assert (out / "model.safetensors").read_bytes() == first
    assert main(["convert", str(src), "--out", str(out), "--layer", "1", "--overwrite"]) == 0
    assert list(load_converted(out)) == [1] and not [p for p in out.iterdir() if ".tmp" in p.name]
    (tmp_path / "afile").write_text("x")
    refused(["convert", str(src), "--out", str(tmp_path / "afile")], "--out: .*afile is a file")
    refused(["convert", str(src), "--out", str(tmp_path / "o2"), "--calibration-tokens", "64"],
            "--calibration-tokens: sizes the warm start's calibration batch; give --warm-start too")
    refused(["convert", str(src), "--out", str(tmp_path / "o2"), "--qk-norm", "rms", "--warm-start",
             "--calibration-tokens", "1000000000"], r"--calibration-tokens: .* need at least .* GiB, more than the")
    assert not (tmp_path / "o2").exists()
