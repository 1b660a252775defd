"""``qkmla generate --hf DIR``: a saved transformers checkpoint generates through the latent cache."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from qkmla.cli import main  # noqa: E402
from qkmla.integrations.transformers import apply_latent_attention  # noqa: E402
from qkmla.integrations.transformers.generate import load_hf_dir  # noqa: E402

from .test_model import hf_model  # noqa: E402


def byte_tokenizer():
    """A byte-level tokenizer of 97 symbols (the test models' vocabulary), built offline."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())[:96]
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<pad>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    model = hf_model("v3", dtype=torch.float32)
    model.save_pretrained(root)
    byte_tokenizer().save_pretrained(root)
    return root


def test_generate_hf_prints_what_the_patched_model_generates(checkpoint, capsys):
    prompts = ["abc", "hello there"]
    assert main(["generate", "--hf", str(checkpoint), "--prompt", prompts[0], "--prompt", prompts[1],
                 "--tokens", "6", "--temperature", "0"]) == 0
    printed = [block.strip("\n") for block in capsys.readouterr().out.split("-" * 40)][:2]
    model, tok = load_hf_dir(checkpoint)
    apply_latent_attention(model)
    for prompt, text in zip(prompts, printed):  # each prompt alone gives what the batch gave it
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert text == prompt + tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_hf_with_quantized_cache_and_policy(checkpoint, capsys):
    assert main(["generate", "--hf", str(checkpoint), "--prompt", "abcdefgh", "--tokens", "4", "--kv-format", "int8",
                 "--policy", "streaming-llm", "--budget", "6", "--temperature", "0.7", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("abcdefgh")


def test_another_architecture_is_refused_before_loading(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["generate", "--hf", str(tmp_path)]) == 2
    assert f"qkmla generate: --hf: {tmp_path} holds a 'llama' model" in capsys.readouterr().err
    assert main(["generate", "--hf", str(tmp_path / "nowhere")]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_a_checkpoint_whose_tensors_disagree_with_its_config_is_refused(checkpoint, tmp_path, capsys):
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["kv_lora_rank"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--hf", str(tmp_path), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "does not load as its config describes it" in err and "internal error" not in err
    # a layer more than the weights hold was built with random weights, and generated from
    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    assert main(["generate", "--hf", str(tmp_path), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"describes {config['num_hidden_layers'] + 1} layers" in err and "no attention weights for layer" in err


def test_run_and_hf_are_exclusive_and_length_is_checked(checkpoint, capsys):
    assert main(["generate"]) == 2
    assert "either a qkmla run directory or --hf DIR (a transformers checkpoint); got neither" in \
        capsys.readouterr().err
    assert main(["generate", "--hf", str(checkpoint), "--tokens", "1000"]) == 2
    assert "--tokens: the longest prompt" in capsys.readouterr().err


def test_prompts_get_the_beginning_token_a_tokenizer_adds_but_never_an_end_token():
    """T5-style tokenizers append </s> by default; a continuation must not start after it.
    Llama-style ones prepend <s>, which the model was trained to see first."""
    from qkmla.integrations.transformers.generate import prompt_ids

    byt5 = transformers.ByT5Tokenizer()
    assert byt5("ROMEO:")["input_ids"][-1] == byt5.eos_token_id
    assert prompt_ids(byt5, "ROMEO:") == [b + 3 for b in b"ROMEO:"]
    with_bos = byte_tokenizer()
    with_bos.bos_token = "<pad>"
    with_bos._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<pad> $A", special_tokens=[("<pad>", with_bos.pad_token_id)])
    plain = with_bos("abc", add_special_tokens=False)["input_ids"]
    assert prompt_ids(with_bos, "abc") == [with_bos.bos_token_id] + plain
    assert prompt_ids(byte_tokenizer(), "abc") == plain
    assert prompt_ids(byt5, "") == [byt5.eos_token_id]  # an empty prompt: what marks an empty text
    with pytest.raises(ValueError, match="prompts: '' has no tokens and this tokenizer adds none"):
        prompt_ids(byte_tokenizer(), "")


def test_generate_hf_refuses_what_python_callers_mistype_before_loading(checkpoint, monkeypatch):
    """Probe 10b (q03, q05, q06): ``generate_hf(dir, "abc")`` (a str, not a list of prompts) continued "a", "b" and
    "c" as three prompts without a word; ``seed=-1`` was taken; ``prompts=["abc", 5]`` failed in the tokenizer's
    type check; ``kv_format="junk"`` was refused only after the model was loaded. Each is refused naming the
    argument, before anything is loaded."""
    from qkmla.integrations.transformers import generate as module

    loaded = []
    monkeypatch.setattr(module, "load_hf_dir", lambda *a, **k: loaded.append(a))
    for kwargs, match in ((dict(prompts="abc"), "^prompts: expected a list of strings, one per prompt, got 'abc'"),
                          (dict(prompts=["abc", 5]), "^prompts: expected a list of strings"),
                          (dict(prompts=b"abc"), "^prompts: expected a list of strings"),
                          (dict(prompts=["abc"], seed=-1), "^seed: expected an int from 0 to 2\\*\\*32 - 1 .*got -1"),
                          (dict(prompts=["abc"], seed=True), "^seed: expected an int .*got True"),
                          (dict(prompts=["abc"], kv_format="junk"), "^kv_format: expected one of")):
        with pytest.raises(ValueError, match=match):
            module.generate_hf(checkpoint, max_new_tokens=2, **kwargs)
    assert loaded == []
    monkeypatch.undo()
    assert module.generate_hf(checkpoint, ("abc",), max_new_tokens=2)[0].startswith("abc")  # a tuple is a list
