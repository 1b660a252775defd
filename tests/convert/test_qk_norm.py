"""``qkmla convert --hf SRC --out DST``: a whole checkpoint given a calibrated QK norm, every other
tensor kept, written once, read back by ``from_pretrained`` and ``qkmla generate --hf``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from qkmla.cli import main  # noqa: E402
from qkmla.integrations.transformers import from_pretrained  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402

from tests.integrations.transformers.test_model import SHAPE  # noqa: E402


def tensors(directory) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random DeepSeek-V3 checkpoint in several shards, with a byte-level tokenizer."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**SHAPE, "vocab_size": 300}, q_lora_rank=24,
                                           rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name and p.dim() == 2:
                p.mul_(3.0)
    path = tmp_path_factory.mktemp("src")
    model.save_pretrained(path, max_shard_size="60KB")
    transformers.ByT5Tokenizer().save_pretrained(path)
    return path


def snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_convert_keeps_every_tensor_adds_a_calibrated_norm_and_generates(source, tmp_path, capsys):
    before = snapshot(source)
    out = tmp_path / "dst"
    assert main(["convert", "--hf", str(source), "--out", str(out), "--qk-norm", "rms",
                 "--calibration-tokens", "512"]) == 0
    printed = capsys.readouterr().out
    assert "layer 2: content logit RMS" in printed and "held-out loss: source" in printed
    assert snapshot(source) == before
    old, new = tensors(source), tensors(out)
    added = sorted(set(new) - set(old))
    assert not set(old) - set(new) and all(torch.equal(old[k], new[k]) for k in old)
    assert added == sorted(f"model.layers.{i}.self_attn.{side}.{what}"
                           for i in range(3) for side in ("q_norm", "k_norm")
                           for what in ("content.weight", "rope.weight", "_extra_state"))
    assert not any(torch.all(new[k] == 1) for k in added if k.endswith("weight"))  # calibrated, not ones
    assert json.loads((out / "config.json").read_text())["qkmla"]["qk_norm"]["kind"] == "rms"
    model = from_pretrained(out)
    assert all(layer.config.qk_norm.kind == "rms" for layer in latent_layers(model))
    assert main(["generate", "--hf", str(out), "--prompt", "To be", "--tokens", "6"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    assert not [p for p in tmp_path.iterdir() if p.name != "dst"]  # no temporary left


def test_norm_variants_and_no_calibration(source, tmp_path):
    out = tmp_path / "unified"
    assert main(["convert", "--hf", str(source), "--out", str(out), "--qk-norm", "lp", "--qk-norm-p", "3",
                 "--qk-norm-mode", "unified", "--calibration-tokens", "0", "--dtype", "bfloat16"]) == 0
    model = from_pretrained(out)
    layer = latent_layers(model)[0]
    assert (layer.config.qk_norm.kind, layer.config.qk_norm.p, layer.config.qk_norm.mode) == ("lp", 3.0, "unified")
    assert torch.all(layer.q_norm.content.weight == 1) and layer.kv_b_proj.weight.dtype == torch.bfloat16


def test_convert_never_writes_over_its_source_or_an_existing_conversion(source, tmp_path, refused):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    before = snapshot(src)
    for out in (src, src / ".." / "src", src / "inside"):
        refused(["convert", "--hf", str(src), "--out", str(out), "--qk-norm", "rms", "--overwrite"],
                "--out: .* is the checkpoint being converted")
    refused(["convert", "--hf", str(src), "--out", str(tmp_path), "--qk-norm", "rms", "--overwrite"],
            "--out: .* holds the checkpoint being converted")
    assert snapshot(src) == before
    out = tmp_path / "out"
    assert main(["convert", "--hf", str(src), "--out", str(out), "--qk-norm", "rms", "--calibration-tokens", "0"]) == 0
    first = snapshot(out)
    refused(["convert", "--hf", str(src), "--out", str(out), "--qk-norm", "l2"],
            "--out: .* already exists and is not empty; pass --overwrite to replace it")
    assert snapshot(out) == first
    assert main(["convert", "--hf", str(src), "--out", str(out), "--qk-norm", "l2", "--calibration-tokens", "0",
                 "--overwrite"]) == 0
    assert latent_layers(from_pretrained(out))[0].config.qk_norm.kind == "l2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    # The directory is replaced whole: a file of the user's in it was lost with it (probe 8).
    (out / "NOTES.md").write_text("mine")
    refused(["convert", "--hf", str(src), "--out", str(out), "--qk-norm", "l2", "--calibration-tokens", "0",
             "--overwrite"], "--out: .*out holds NOTES.md, which this conversion does not write; --overwrite replaces "
                             "the directory whole, so move it out first")
    assert (out / "NOTES.md").read_text() == "mine"
    (out / "NOTES.md").unlink()
    (tmp_path / "afile").write_text("x")
    refused(["convert", "--hf", str(src), "--out", str(tmp_path / "afile")], "--out: .*afile is a file")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    refused(["convert", "--hf", str(src), "--out", str(tmp_path / "notes"), "--overwrite"],
            "--out: .*notes is not empty and holds no transformers config.json .*, so it is not a checkpoint directory")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_bad_arguments_are_refused_before_any_work(source, tmp_path, refused, capsys):
    bad = str(tmp_path / "bad")
    no_tokenizer = tmp_path / "bare"
    no_tokenizer.mkdir()
    for p in source.iterdir():
        if p.suffix in (".safetensors", ".json") and "token" not in p.name:
            shutil.copy(p, no_tokenizer / p.name)
    small_vocab = tmp_path / "small-vocab"  # the text's byte ids (ASCII + 3) pass vocab_size
    shutil.copytree(source, small_vocab)
    config = json.loads((small_vocab / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    edited = {}  # config.json edited by hand: transformers builds both, and loads them with a random layer / NaN
    for name, change in (("more-layers", {"num_hidden_layers": config["num_hidden_layers"] + 1}),
                         ("negative-eps", {"rms_norm_eps": -1.0})):
        edited[name] = tmp_path / name
        shutil.copytree(source, edited[name])
        (edited[name] / "config.json").write_text(json.dumps({**config, **change}))
    qk = tmp_path / "qk"
    assert main(["convert", "--hf", str(source), "--out", str(qk), "--qk-norm", "rms",
                 "--calibration-tokens", "0"]) == 0
    cases = [
        *[(["--hf", str(edited["more-layers"]), "--qk-norm", "rms", "--calibration-tokens", tokens],
           f"--hf: .*config.json describes {config['num_hidden_layers'] + 1} layers, and .* holds no attention "
           f"weights for layer {config['num_hidden_layers']}") for tokens in ("0", "256")],
        (["--hf", str(edited["negative-eps"]), "--qk-norm", "rms"], "--hf: .*config.json: rms_norm_eps must be a "
                                                                     "finite number > 0 .*, got -1.0"),
        (["--hf", str(tmp_path / "nowhere")], "--hf: .* is not a directory"),
        (["--hf", str(tmp_path)], "--hf: .*config.json does not exist"),
        (["--hf", str(source), "--calibration-tokens", "64"],
         "--calibration-tokens: calibrates a QK norm being added; name the norm too"),
        (["--hf", str(source), "--qk-norm", "rms", "--calibration-tokens", "8"],
         "--calibration-tokens: expected 0 .* or at least 16, got 8"),
        (["--hf", str(source), "--qk-norm", "rms", "--calibration-tokens", "-1"], "--calibration-tokens: expected an "),
        (["--hf", str(source), "--qk-norm", "rms", "--calibration-tokens", "100000000"],
         "--calibration-tokens: the calibration text has .* tokens, too few"),
        (["--hf", str(source), "--qk-norm", "rms", "--calibration-text", str(tmp_path / "none.txt")],
         "--calibration-text: the calibration text .*none.txt does not exist"),
        (["--hf", str(no_tokenizer), "--qk-norm", "rms"],
         "--hf: .* has no tokenizer .*; pass calibration_tokens=0 \\(--calibration-tokens 0\\)"),
        (["--hf", str(qk), "--qk-norm", "l2"], "--qk-norm: .* already records the QK norm rms blockwise"),
        (["--hf", str(qk), "--qk-norm", "rms"], "--qk-norm: .* with trained weights that adding and calibrating a "
                                                "norm would replace; leave qk_norm out to re-save it"),
        (["--hf", str(source), "--qk-norm-mode", "unified"], "--qk-norm-mode: only read with a qk_norm"),
        (["--hf", str(small_vocab), "--qk-norm", "rms"], "--hf: .*'s tokenizer gives token ids up to .*, beyond the "
                                                         "model's vocab_size 100"),
        (["--hf", str(source), "--qk-norm", "lp", "--qk-norm-p", "0.5"], "--qk-norm-p: expected a finite number >= 1"),
    ]
    for extra, match in cases:
        refused(["convert", "--out", bad, *extra], match)
    capsys.readouterr()  # tensors that disagree with the config: transformers prints its load report first
    assert main(["convert", "--hf", str(small_vocab), "--out", bad, "--qk-norm", "rms",
                 "--calibration-tokens", "0"]) == 2
    assert "qkmla convert: --hf: " in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):  # argparse's choices
        main(["convert", "--hf", str(source), "--out", bad, "--qk-norm", "rmsnorm"])
    assert not (tmp_path / "bad").exists()
    assert main(["convert", "--hf", str(no_tokenizer), "--out", bad, "--qk-norm", "rms",
                 "--calibration-tokens", "0"]) == 0  # no tokenizer needed without calibration


def test_the_api_names_its_own_arguments(source, tmp_path):
    """convert_checkpoint(src, out) named its source "hf", the command's option, an argument it does not have."""
    from qkmla.convert import convert_checkpoint

    bare = tmp_path / "bare"
    bare.mkdir()
    for p in source.iterdir():
        if p.suffix in (".safetensors", ".json") and "token" not in p.name:
            shutil.copy(p, bare / p.name)
    for src, match in ((tmp_path / "nowhere", r"^src: .* is not a directory"),
                       (bare, r"^src: .* has no tokenizer transformers can load"),
                       (b"\xff".decode("utf-8", "surrogateescape"), r"^src: ")):
        with pytest.raises(ValueError, match=match):
            convert_checkpoint(src, tmp_path / "out", qk_norm="rms")
    assert not (tmp_path / "out").exists()
    # the streamed reader's refusals too (they named hf_dir, the loaders' argument)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    with pytest.raises(ValueError, match=r"^src: .*config.json describes .* layers"):
        convert_checkpoint(bare, tmp_path / "out", qk_norm="rms", calibration_tokens=0)
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_symbolic_link_is_written_where_it_points(source, tmp_path, refused):
    """``ln -s /scratch/models/x out``: the conversion lands in the directory the link points to and
    the link stays. The link itself was replaced by the new directory, and left behind as
    ``out.replacedPID``; a link to nothing failed only at the final rename, after all the work."""
    target = tmp_path / "big-disk" / "model"
    target.mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(target)
    argv = ["convert", "--hf", str(source), "--out", str(link), "--qk-norm", "rms", "--calibration-tokens", "0"]
    assert main(argv) == 0
    assert link.is_symlink() and (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big-disk", "out"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no lock or temporary left
    assert main([*argv, "--overwrite"]) == 0 and link.is_symlink()
    assert latent_layers(from_pretrained(link))[0].config.qk_norm.kind == "rms"
    dangling = tmp_path / "nowhere-link"
    dangling.symlink_to(tmp_path / "nowhere")
    refused(["convert", "--hf", str(source), "--out", str(dangling), "--qk-norm", "rms"],
            "--out: .*nowhere-link is a symbolic link to .*nowhere, which does not exist; make that directory")
    assert not (tmp_path / "nowhere").exists()
