"""A QK-normed checkpoint identifies itself (issue 52, point 3): it declares qkmla's model type and
architecture (``qkmla_deepseek_v3``, ``QKNormDeepseekV3ForCausalLM``; V2 likewise) with an
``auto_map`` and the code it names, so transformers' Auto classes and ``pipeline`` load it with its
norm where qkmla is imported, ``trust_remote_code=True`` where it is only installed, and
transformers without qkmla refuses it by name; a hub repository loads by id, revision and cache
directory. Plain patched models stay stock DeepSeek checkpoints, and checkpoints in the earlier
formats (``deepseek_v3`` with the record; the flat record) still load."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from qkmla import QKNormConfig  # noqa: E402
from qkmla.integrations.hub import mla_layers_from_hf_dir  # noqa: E402
from qkmla.integrations.hub.config import mla_config_from_hf  # noqa: E402
from qkmla.integrations.hub.record import CODE, LOADER, RECORD, recorded_norm  # noqa: E402
from qkmla.integrations.transformers import (QKNormDeepseekV2ForCausalLM, QKNormDeepseekV3ForCausalLM,  # noqa: E402
                                             apply_latent_attention, from_pretrained)
from qkmla.integrations.transformers.auto import QKNormDeepseekV3Config  # noqa: E402
from qkmla.integrations.transformers.generate import load_hf_dir  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402

from .test_generate import byte_tokenizer  # noqa: E402
from .test_model import hf_model, max_rel, patched, prompts  # noqa: E402
from .test_qknorm import _gqa_model, norm_names, perturb_norms  # noqa: E402

OURS = {"v2": ("qkmla_deepseek_v2", QKNormDeepseekV2ForCausalLM),
        "v3": ("qkmla_deepseek_v3", QKNormDeepseekV3ForCausalLM)}
STOCK = {"v2": ("deepseek_v2", transformers.DeepseekV2ForCausalLM),
         "v3": ("deepseek_v3", transformers.DeepseekV3ForCausalLM)}


def qk_model(variant="v3", seed=0):
    """A float32 model with qkmla's RMS QK norm, its norm weights away from ones."""
    model = patched(hf_model(variant, dtype=torch.float32), qk_norm="rms")
    perturb_norms(model, seed)
    return model


def save(model, directory, tokenizer=False):
    model.save_pretrained(directory, max_shard_size="40KB")  # several shards, norm weights among them
    if tokenizer:
        byte_tokenizer().save_pretrained(directory)
    return directory


def same_model(loaded, model) -> None:
    """The same parameters and buffers bit for bit, logits to float32 roundoff (test_qknorm.py)."""
    params, got = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert sorted(got) == sorted(params) and all(torch.equal(got[n], params[n]) for n in params)
    buffers, got = dict(model.named_buffers()), dict(loaded.named_buffers())
    assert sorted(got) == sorted(buffers) and all(torch.equal(got[n], buffers[n]) for n in buffers)
    ids = torch.stack(prompts([9, 9]))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)


def config_json(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_a_qk_normed_checkpoint_declares_its_own_model_type_and_architecture(variant, tmp_path):
    """config.json names qkmla's model type, architecture and the code auto_map points to (written
    beside it); the tensors are the stock checkpoint's, under the same names, plus the norm's."""
    model = qk_model(variant)
    save(model, tmp_path / "qk")
    saved = config_json(tmp_path / "qk")
    model_type, cls = OURS[variant]
    assert saved["model_type"] == model_type and saved["architectures"] == [cls.__name__]
    assert saved["auto_map"] == {"AutoConfig": f"{CODE}.{cls.config_class.__name__}",
                                 "AutoModelForCausalLM": f"{CODE}.{cls.__name__}"}
    assert QKNormConfig.of(saved[RECORD]["qk_norm"]) == QKNormConfig("rms") and saved["attn_implementation"] == LOADER
    code = (tmp_path / "qk" / f"{CODE}.py").read_text()
    assert "from qkmla.integrations.transformers.auto import" in code and cls.__name__ in code
    assert type(model.config).model_type == model_type and isinstance(model.config, STOCK[variant][1].config_class)

    stock = hf_model(variant, dtype=torch.float32)  # the same model unpatched, saved by transformers
    stock.save_pretrained(tmp_path / "stock", max_shard_size="40KB")
    index = lambda d: set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])  # noqa: E731
    ours = {k for k in index(tmp_path / "qk") if ".q_norm." in k or ".k_norm." in k}  # weights, variant records
    assert set(norm_names(model)) < ours and index(tmp_path / "qk") - ours == index(tmp_path / "stock")
    other = {k: v for k, v in config_json(tmp_path / "stock").items() if k not in ("model_type", "architectures")}
    assert {k: v for k, v in saved.items() if k in other} == other  # every stock field as transformers writes it


@pytest.mark.parametrize("variant, load", [("v3", "auto"), ("v3", "class"), ("v2", "auto")])
def test_the_auto_classes_load_it_with_its_norm(variant, load, tmp_path):
    """With qkmla imported, AutoModelForCausalLM (and qkmla's class itself) gives qkmla's architecture
    with the trained norm: the saved model, bit for bit; saved again, the same checkpoint. (With
    trust_remote_code=True too: in a fresh process, below, so that transformers' module cache is the
    test's.)"""
    model = qk_model(variant)
    save(model, tmp_path / "a")
    model_type, cls = OURS[variant]
    loaders = {"auto": lambda p: transformers.AutoModelForCausalLM.from_pretrained(p), "class": cls.from_pretrained}
    loaded = loaders[load](str(tmp_path / "a"))
    assert type(loaded) is cls and type(loaded.config) is cls.config_class and not loaded.training
    assert recorded_norm(loaded.config) == QKNormConfig("rms")
    same_model(loaded, model)
    assert torch.equal(loaded.generate(torch.stack(prompts([7, 7])), max_new_tokens=4, do_sample=False),
                       model.generate(torch.stack(prompts([7, 7])), max_new_tokens=4, do_sample=False))
    apply_latent_attention(loaded, kv_format="int8")  # still qkmla's patched model: settings change, norm kept
    assert latent_layers(loaded)[0].settings.kv_format == "int8" and latent_layers(loaded)[0].q_norm is not None
    save(loaded, tmp_path / "b")
    first, again = config_json(tmp_path / "a"), config_json(tmp_path / "b")
    assert first == again
    assert (tmp_path / "b" / f"{CODE}.py").read_text() == (tmp_path / "a" / f"{CODE}.py").read_text()


def test_a_pipeline_generates_with_the_norm(tmp_path):
    model = qk_model("v3")
    save(model, tmp_path, tokenizer=True)
    pipe = transformers.pipeline("text-generation", model=str(tmp_path))
    assert type(pipe.model) is QKNormDeepseekV3ForCausalLM and norm_names(pipe.model) == norm_names(model)
    tokenizer = byte_tokenizer()
    inputs = tokenizer("abcdefgh", return_tensors="pt")
    want = tokenizer.decode(model.generate(**inputs, max_new_tokens=6, do_sample=False)[0])
    got = pipe("abcdefgh", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert got == want
    # and qkmla generate --hf reads the directory as it reads a stock one
    loaded, _ = load_hf_dir(tmp_path)
    same_model(loaded, model)


def test_from_config_builds_the_recorded_norm(tmp_path):
    """A model built from a QK-normed config (no weights): transformers' DeepSeek model patched with the
    recorded norm, its weights at ones. A config of qkmla's model type without a norm is refused."""
    save(qk_model("v3"), tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config) is QKNormDeepseekV3Config
    built = transformers.AutoModelForCausalLM.from_config(config)
    assert type(built) is QKNormDeepseekV3ForCausalLM and norm_names(built) == norm_names(qk_model("v3"))
    assert all(bool((p == 1).all()) for n, p in built.named_parameters() if ".q_norm." in n or ".k_norm." in n)
    bare = copy.deepcopy(config)
    delattr(bare, RECORD)
    with pytest.raises(ValueError, match=r"config: model_type 'qkmla_deepseek_v3' is a QK-normed checkpoint's, but "
                                         r"its 'qkmla' entry records no QK norm; a model without one is a "
                                         r"'deepseek_v3' model"):
        transformers.AutoModelForCausalLM.from_config(bare)


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_a_plain_patched_model_saves_a_stock_deepseek_checkpoint(variant, tmp_path):
    """No norm, nothing of qkmla's: transformers' model type and architecture, no auto_map, no code;
    stock transformers loads it as its own class. A GQA conversion without a norm too (transformers
    alone computes its function)."""
    model_type, cls = STOCK[variant]
    for name, model in (("patched", patched(hf_model(variant, dtype=torch.float32))),
                        ("gqa", apply_latent_attention(_gqa_model().float()) if variant == "v3" else None)):
        if model is None:
            continue
        save(model, tmp_path / name)
        saved = config_json(tmp_path / name)
        assert saved["model_type"] == model_type and saved["architectures"] == [cls.__name__], name
        assert "auto_map" not in saved and "attn_implementation" not in saved and "qk_norm" not in saved.get(RECORD, {})
        assert not (tmp_path / name / f"{CODE}.py").exists() and type(model.config) is cls.config_class
        alone = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert type(alone) is cls and type(alone.config) is cls.config_class


def _earlier_format(directory, flat: bool = False) -> None:
    """Rewrite a saved QK-normed checkpoint as qkmla wrote it before its model types: transformers'
    model type and architecture with the record (and, with ``flat``, the record as before QKNormConfig
    and the old loader's name)."""
    saved = config_json(directory)
    saved.pop("auto_map")
    saved["model_type"] = saved["model_type"].removeprefix("qkmla_")
    saved["architectures"] = [saved["architectures"][0].removeprefix("QKNorm")]
    if flat:
        saved["attn_implementation"] = "qkmla.interop.from_pretrained"
        saved[RECORD] = {"qk_norm": "rms", "qk_norm_mode": "blockwise", "qk_norm_p": 2.0, "qk_norm_eps": 1e-6}
    (directory / "config.json").write_text(json.dumps(saved))
    (directory / f"{CODE}.py").unlink()


@pytest.mark.parametrize("flat", [False, True], ids=["deepseek_v3-with-record", "flat-record"])
def test_checkpoints_in_the_earlier_formats_load_and_save_in_the_new_one(flat, tmp_path):
    model = qk_model("v3")
    _earlier_format(save(model, tmp_path / "old"), flat)
    back = from_pretrained(tmp_path / "old")
    same_model(back, model)
    layers = mla_layers_from_hf_dir(tmp_path / "old")  # the layer-level loader reads them as it did
    assert all(layer.config.qk_norm == QKNormConfig("rms") for layer in layers.values())
    with pytest.raises(ValueError, match=LOADER.replace(".", r"\.") if not flat else "qkmla.interop.from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "old")  # transformers' type: refused as before
    save(back, tmp_path / "new")
    assert config_json(tmp_path / "new")["model_type"] == "qkmla_deepseek_v3"
    same_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "new"), model)


def test_every_loader_of_the_package_reads_the_new_model_type(tmp_path):
    """The layer-level loaders and the checks read qkmla's model type as DeepSeek's (V2's interleaved
    RoPE included), with the record; without a record it is refused, by every loader, before any weight."""
    for variant in ("v2", "v3"):
        model = qk_model(variant)
        directory = save(model, tmp_path / variant)
        saved = config_json(directory)
        config = mla_config_from_hf(saved)
        assert config.qk_norm == QKNormConfig("rms") and config.rope_interleave
        assert config == latent_layers(model)[0].config.replace(decode_backend=config.decode_backend)
        layers = mla_layers_from_hf_dir(directory)
        x = torch.randn(2, 6, 64)
        with torch.no_grad():
            for i, attn in enumerate(latent_layers(model)):
                assert max_rel(layers[i].eval()(x), attn(x)[0]) < 1e-5
    saved = config_json(tmp_path / "v3")
    saved.pop(RECORD)
    (tmp_path / "v3" / "config.json").write_text(json.dumps(saved))
    match = r"model_type 'qkmla_deepseek_v3' is a QK-normed checkpoint's, but its 'qkmla' entry records no QK norm"
    for load in (from_pretrained, mla_layers_from_hf_dir, transformers.AutoModelForCausalLM.from_pretrained,
                 lambda d: mla_config_from_hf(config_json(d))):
        with pytest.raises(ValueError, match=match):
            load(tmp_path / "v3")


def test_from_pretrained_arguments_for_where_the_checkpoint_is(tmp_path):
    model = qk_model("v3")
    save(model, tmp_path / "repo" / "sub")
    same_model(from_pretrained(tmp_path / "repo", subfolder="sub"), model)
    with pytest.raises(ValueError, match="proxies: the hub client takes proxies from the HTTP_PROXY"):
        from_pretrained(tmp_path / "repo", subfolder="sub", proxies={"https": "http://proxy"})
    with pytest.raises(ValueError, match=r"model_args: QKNormDeepseekV3ForCausalLM.from_pretrained takes its "
                                         r"arguments by name"):
        QKNormDeepseekV3ForCausalLM.from_pretrained(tmp_path / "repo" / "sub", "positional")
    with pytest.raises(ValueError, match=r"config: records l2 blockwise, but .* records rms blockwise"):
        from_pretrained(tmp_path / "repo" / "sub", config=patched(hf_model("v3"), qk_norm="l2").config)
    with pytest.raises(ValueError, match=r"v2 holds a DeepseekV2ForCausalLM, not a DeepseekV3ForCausalLM; load it "
                                         r"with AutoModelForCausalLM"):
        save(qk_model("v2"), tmp_path / "v2")
        QKNormDeepseekV3ForCausalLM.from_pretrained(tmp_path / "v2")


# -- in fresh processes: transformers without qkmla imported, and the hub offline -------------------

def run(script: str, tmp_path, **env) -> dict:
    """Run ``script`` in a fresh Python (this one's interpreter: the same transformers), offline, with
    transformers' module cache and the hub's home under ``tmp_path``; returns what it prints last, as JSON."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home"),
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "TRANSFORMERS_VERBOSITY": "error", **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.rpartition(RESULT)[2])  # transformers prints its trust_remote_code prompt


def expected(model, path) -> None:
    """What a process that loads ``model`` must compute: its state and logits on fixed tokens."""
    ids = torch.stack(prompts([9, 9]))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(input_ids=ids).logits, "state": model.state_dict()}, path)


RESULT = "RESULT: "
CHECK = f"""
RESULT = {RESULT!r}

def same(model, path):
    import torch
    want = torch.load(path)
    state = model.state_dict()
    with torch.no_grad():
        logits = model(input_ids=want["ids"]).logits
    return (sorted(state) == sorted(want["state"]) and all(torch.equal(state[k], want["state"][k]) for k in state)
            and torch.allclose(logits, want["logits"], rtol=1e-6, atol=1e-6))

def refusal(load):
    try:
        load()
    except Exception as e:
        return type(e).__name__ + ": " + " ".join(str(e).split())
    return "loaded"
"""


def test_transformers_without_qkmla_refuses_it_by_name_and_trust_remote_code_loads_it(tmp_path):
    """A fresh process that never imports qkmla: the Auto classes and pipeline refuse the model type,
    asking for trust_remote_code (asked for sdpa too: before qkmla's model type, that loaded the
    checkpoint as plain DeepSeek, dropping the norm weights as "unexpected"); the DeepSeek class refuses
    the recorded loader. trust_remote_code=True loads qkmla's architecture through the code the
    checkpoint carries, which imports the installed qkmla: the saved model, norm included."""
    model = qk_model("v3")
    save(model, tmp_path / "ckpt", tokenizer=True)
    expected(model, tmp_path / "want.pt")
    got = run(CHECK + f"""
import json, sys
import transformers
d, want = {str(tmp_path / "ckpt")!r}, {str(tmp_path / "want.pt")!r}
out = {{"auto": refusal(lambda: transformers.AutoModelForCausalLM.from_pretrained(d)),
        "auto-sdpa": refusal(lambda: transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa")),
        "config": refusal(lambda: transformers.AutoConfig.from_pretrained(d)),
        "pipeline": refusal(lambda: transformers.pipeline("text-generation", model=d)),
        "class": refusal(lambda: transformers.DeepseekV3ForCausalLM.from_pretrained(d))}}
out["qkmla imported"] = "qkmla" in sys.modules
model = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
out["trusted"] = [type(model).__module__ + "." + type(model).__name__, same(model, want)]
pipe = transformers.pipeline("text-generation", model=d, trust_remote_code=True)
out["pipeline trusted"] = [type(pipe.model).__name__, same(pipe.model, want)]
print(RESULT + json.dumps(out))
""", tmp_path)
    for load in ("auto", "auto-sdpa", "config", "pipeline"):
        assert got[load].startswith("ValueError") and "contains custom code" in got[load]
        assert "trust_remote_code=True" in got[load]
    assert "ValueError" in got["class"] and LOADER in got["class"]
    assert got["qkmla imported"] is False
    assert got["trusted"] == ["qkmla.integrations.transformers.auto.QKNormDeepseekV3ForCausalLM", True]
    assert got["pipeline trusted"] == ["QKNormDeepseekV3ForCausalLM", True]


def fake_hub_cache(cache, repo: str, revisions: dict[str, tuple[str, object]]) -> None:
    """A hub cache holding ``repo`` as huggingface_hub lays it out: {ref: (commit hash, checkpoint
    directory)} becomes snapshots/<commit>/... and refs/<ref>."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for ref, (commit, directory) in revisions.items():
        shutil.copytree(directory, root / "snapshots" / commit, dirs_exist_ok=True)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)


def test_a_hub_repository_loads_by_id_revision_and_cache_dir_offline(tmp_path):
    """A repository in a hub cache (two revisions with different norm weights), offline: loaded by repo
    id at a branch, a tag or a commit, from cache_dir or HF_HUB_CACHE, by qkmla's from_pretrained,
    AutoModelForCausalLM and pipeline, and by trust_remote_code in a process without qkmla."""
    main, v1 = qk_model("v3", seed=0), qk_model("v3", seed=1)
    for name, model in (("main", main), ("v1", v1)):
        save(model, tmp_path / name, tokenizer=True)
        expected(model, tmp_path / f"{name}.pt")
    commits = {"main": "a" * 40, "v1": "b" * 40}
    fake_hub_cache(tmp_path / "hub", "qkmla-test/tiny-qk", {ref: (commits[ref], tmp_path / ref) for ref in commits})
    script = CHECK + f"""
import json, sys
import transformers
cache, repo = {str(tmp_path / "hub")!r}, "qkmla-test/tiny-qk"
want = {{"main": {str(tmp_path / "main.pt")!r}, "v1": {str(tmp_path / "v1.pt")!r}}}
out = {{"qkmla imported first": "qkmla" in sys.modules}}
"""
    with_qkmla = """
from qkmla.integrations.transformers import from_pretrained
loads = {
    "auto, tag v1, cache_dir": ("v1", lambda: transformers.AutoModelForCausalLM.from_pretrained(
        repo, revision="v1", cache_dir=cache)),
    "auto, main, HF_HUB_CACHE": ("main", lambda: transformers.AutoModelForCausalLM.from_pretrained(repo)),
    "auto, trust_remote_code": ("main", lambda: transformers.AutoModelForCausalLM.from_pretrained(
        repo, cache_dir=cache, trust_remote_code=True)),
    "qkmla, commit of v1, cache_dir": ("v1", lambda: from_pretrained(repo, revision="b" * 40, cache_dir=cache)),
    "qkmla, main, HF_HUB_CACHE": ("main", lambda: from_pretrained(repo)),
    "pipeline, v1": ("v1", lambda: transformers.pipeline("text-generation", model=repo, revision="v1").model),
}
for name, (ref, load) in loads.items():
    model = load()
    out[name] = [type(model).__name__, same(model, want[ref]), model.name_or_path]
out["missing"] = refusal(lambda: from_pretrained(repo, revision="c" * 40))
print(RESULT + json.dumps(out))
"""
    got = run(script + with_qkmla, tmp_path, HF_HUB_CACHE=str(tmp_path / "hub"))
    assert got.pop("qkmla imported first") is False
    assert got.pop("missing").startswith("ValueError: hf_dir: qkmla-test/tiny-qk is not a directory, and as a hub "
                                         "repository (revision cccc")
    for name, value in got.items():
        cls = "DeepseekV3ForCausalLM" if name.startswith("qkmla") else "QKNormDeepseekV3ForCausalLM"
        assert value == [cls, True, "qkmla-test/tiny-qk"], name
    without_qkmla = """
out["untrusted"] = refusal(lambda: transformers.AutoModelForCausalLM.from_pretrained(repo, cache_dir=cache))
model = transformers.AutoModelForCausalLM.from_pretrained(repo, revision="v1", cache_dir=cache, trust_remote_code=True)
out["trusted, v1"] = [type(model).__name__, same(model, want["v1"])]
print(RESULT + json.dumps(out))
"""
    got = run(script + without_qkmla, tmp_path)
    assert got["qkmla imported first"] is False and got["trusted, v1"] == ["QKNormDeepseekV3ForCausalLM", True]
    assert "contains custom code" in got["untrusted"] and "trust_remote_code=True" in got["untrusted"]
