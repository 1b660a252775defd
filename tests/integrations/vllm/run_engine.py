"""One vLLM engine on one checkpoint, in its own process (vLLM's tests/plugins pattern): greedy
tokens and their logprobs as JSON on the stdout line that starts with RESULT_TAG.

    python run_engine.py '{"model": DIR, "dtype": "float32", "prompts": [[5, 6, 7]], "max_tokens": 12}'

``"ignore_key_scalars": true`` is the negative control: decode as if every cached key scalar
were 1 (the prefill still uses them), which must break the match with qkmla's generation.
``"engine"``: more ``vllm.LLM`` arguments. ``"cached_context": true`` keeps chunked prefill and
prefix caching on (``engine`` gives ``max_num_batched_tokens``) and serves the prompts twice, the
second time from the prefix cache, and with ``"narrow_context": true`` gathers the context as vLLM's
CUDA gather does (a [c | k_rope] workspace, the first values of each wider row), so each context
key's scalar is recomputed; ``"amx_configuration": true`` serves them twice in the
configuration vLLM gives a CPU with AMX (faked on one without). ``"parallel"``: ``tensor_parallel_size`` and
``pipeline_parallel_size``, each rank in its own worker process (vLLM's multiprocessing executor),
one CPU each (``VLLM_CPU_OMP_THREADS_BIND``, unless already set); the patches above reach only
this process, so they are refused with more than one rank. ``"eager": false`` compiles the model.
``"decode_backend"``: the decode op's backend in the QK-normed layers (the plugin's default:
"auto"); the result counts the calls that reached the CPU kernel (``cpu_kernel_calls``), and
those that formed key scalars through the CPU kernel (``key_scalar_kernel_calls``).
``"reload": {"model": DIR2, "via": "reload_weights" | "load_weights", "only": [...]}``: after serving
the prompts, load DIR2's weights into the running engine in place (vLLM's ``reload_weights``, what RL
weight sync runs, or the model's own ``load_weights`` called directly, with the tensors whose names
contain one of ``only``) and serve them again: the result is the second serving's (the first one's
tokens as ``tokens_before_reload``). ``"vllm_version"``: the version vLLM reports (``vllm.__version__``),
as if another release were installed. The result names the model's class (``model_class``).
``"key_scalars": true``: the result holds, for each rank and QK-normed layer, the key scalars its
cache holds by slot and its logit scale (``key_scalars_by_rank``).
"""

import json
import os
import sys

CONTEXT_CALLS: list = []  # prefills that attended over cached context (with "cached_context")
RESULT_TAG = "qkmla-engine-result "  # worker processes may log to stdout after the result
PATCHES = ("ignore_key_scalars", "cached_context", "narrow_context", "amx_configuration",
           "decode_backend", "vllm_version")  # this process only
KERNEL_CALLS: list = []  # decode calls that reached the CPU kernel
STATISTIC_CALLS: list = []  # key scalars formed through the CPU kernel (ops.small_linear.group_statistic)


def qk_layers(model) -> list:
    """[local heads, key scalars per cached row] of each QK-normed attention layer in one rank's
    model (a module-level function: ranks in other processes get it by name)."""
    from qkmla.integrations.vllm.attention import QKNormLatentAttention

    return [[m.num_heads, m.mla_attn.num_key_scalars] for m in model.modules() if isinstance(m, QKNormLatentAttention)]


def key_weights_read_in_place(model) -> list:
    """For each QK-normed layer of one rank, how the key scalars read W_UK: "vLLM's view" (qkmla's
    CPU kernel reads vLLM's W_UK_T, a strided view of kv_b_proj's weight, where it lies), "in
    place" (a contiguous copy kept by the layer, read as one [h d_n, d_c] matrix by a GEMM) or
    "copied" (on every step)."""
    from qkmla.integrations.vllm.attention import QKNormLatentAttention

    def how(layer):
        w = layer.absorbed.w_uk
        if w.data_ptr() == layer.mla_attn.W_UK_T.data_ptr() and not w.is_contiguous():
            return "vLLM's view"
        try:
            return "in place" if w.view(-1, w.shape[-1]).data_ptr() == w.data_ptr() else "copied"
        except RuntimeError:  # view: the strides allow no such matrix
            return "copied"

    return [how(m) for m in model.modules() if isinstance(m, QKNormLatentAttention) and m.k_norm is not None]


def cache_row_widths(model) -> list:
    """The values per cached token of each QK-normed layer's paged cache in one rank's model."""
    from qkmla.integrations.vllm.attention import QKNormLatentAttention

    return [m.mla_attn.kv_cache.shape[-1] for m in model.modules() if isinstance(m, QKNormLatentAttention)]


def key_scalars_and_logit_scales(model) -> dict:
    """For each QK-normed layer of one rank, by its layer index: the key scalars it cached, by slot
    ({slot: [one per local head]}: the rows whose latent was written, found by a nonzero latent),
    and its logit scale (one per local head, or None)."""
    from qkmla.integrations.vllm.attention import QKNormLatentAttention

    found = {}
    for m in model.modules():
        if isinstance(m, QKNormLatentAttention):
            attn, width = m.mla_attn, m.kv_lora_rank + m.qk_rope_head_dim
            flat = attn.kv_cache.view(-1, attn.kv_cache.shape[-1])
            written = flat[:, :m.kv_lora_rank].abs().sum(-1).nonzero().flatten().tolist()
            scalars = flat[written, width:width + attn.num_key_scalars].double().tolist()
            index = int(attn.layer_name.split(".layers.")[1].split(".")[0])
            found[index] = {"scalars": dict(zip(map(str, written), scalars)),
                            "logit_scale": None if m.logit_scale is None else m.logit_scale.double().tolist()}
    return found


def model_class(model) -> str:
    """The module and name of one rank's model class."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


def load_weights_from(path: str, only, model) -> int:
    """``model.load_weights`` over the tensors of the checkpoint at ``path`` whose names contain one of
    ``only`` (a direct call: vLLM runs nothing after it); the number of weights it reports loaded."""
    from pathlib import Path

    from safetensors.torch import load_file

    def weights():
        for f in sorted(Path(path).glob("*.safetensors")):
            yield from ((k, t) for k, t in load_file(f).items() if any(part in k for part in only))
    return len(model.load_weights(weights()))


def main() -> None:
    args = json.loads(sys.argv[1])
    parallel = args.get("parallel", {})
    ranks = parallel.get("tensor_parallel_size", 1) * parallel.get("pipeline_parallel_size", 1)
    if ranks > 1 and any(args.get(name) for name in PATCHES):
        raise SystemExit(f"{', '.join(n for n in PATCHES if args.get(n))}: patches this process, not the "
                         f"worker processes of {ranks} ranks")
    # The engine core (and with one rank its worker) in this process, so that the patches reach them.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams

    if args.get("vllm_version"):
        vllm.__version__ = args["vllm_version"]

    if args.get("ignore_key_scalars"):
        from qkmla.integrations.vllm import backend

        decode = backend.mla_decode_with_kvcache
        backend.mla_decode_with_kvcache = lambda *a, scale_cache=None, **kw: decode(*a, scale_cache=None, **kw)
    from qkmla.integrations.vllm import backend as qk_backend
    from qkmla.ops.mla_decode import interface

    if args.get("decode_backend"):
        qk_backend.BACKENDS["cpu"] = (qk_backend.BACKENDS["cpu"][0], args["decode_backend"])
    kernel = interface.cpu_mla_decode

    def counted_kernel(*a, **kw):
        KERNEL_CALLS.append(1)
        return kernel(*a, **kw)
    interface.cpu_mla_decode = counted_kernel
    import torch
    from qkmla.ops.small_linear import interface as small_linear

    bind = small_linear.bind_group_statistic  # what the layers' prepare() binds for their cache writes

    def counted_bind(w, *a, **kw):
        bound = bind(w, *a, **kw)

        def counted(x):
            if (x.dtype == torch.bfloat16 and x.shape[0] <= small_linear.GROUP_KERNEL_MAX_ROWS
                    and small_linear.group_kernel_takes(w)):  # the calls the kernel takes
                STATISTIC_CALLS.append(1)
            return bound(x)
        return counted
    small_linear.bind_group_statistic = counted_bind

    amx = bool(torch.cpu._is_amx_tile_supported())
    if args.get("amx_configuration"):
        # What vLLM sets up where the CPU has AMX: AMX_MLA as the platform's MLA backend (qkmla's
        # layers keep their own), 128-token blocks, chunked prefill and prefix caching on. Faked
        # where it has none, in float32 only: in bfloat16 vLLM's other CPU kernels would then run
        # AMX instructions.
        torch.cpu._is_amx_tile_supported = lambda: True
    if args.get("cached_context"):
        # vLLM turns chunked prefill and prefix caching off for CPU_MLA (it turns them on only
        # where AMX_MLA runs); this keeps what the engine arguments ask for, so that the prefill's
        # attention over cached context runs on any CPU.
        from vllm.platforms.cpu import CpuPlatform

        update = CpuPlatform.check_and_update_config.__func__

        def keep_cached_context(cls, vllm_config):
            update(cls, vllm_config)
            vllm_config.scheduler_config.enable_chunked_prefill = True
            vllm_config.scheduler_config.max_num_batched_tokens = args["engine"]["max_num_batched_tokens"]
            vllm_config.cache_config.enable_prefix_caching = True
        CpuPlatform.check_and_update_config = classmethod(keep_cached_context)
    if args.get("narrow_context"):
        # vLLM's CUDA gather (gather_and_maybe_dequant_cache) into its [c | k_rope] workspace copies
        # the first 576 values of each row, read with the row's stride; the CPU's would refuse a
        # wider row. Both as CUDA has them: vLLM's workspace, the CPU gather reading those values.
        from vllm import _custom_ops as ops

        from qkmla.integrations.vllm import backend

        backend.wide_workspace_builder = lambda base: base
        backend.cpu_backend().row_alignment = backend.CUDA_ROW_ALIGNMENT  # rows padded as on CUDA
        gather = ops.gather_mla_context_cache_cpu

        def first_values(*, src_cache, dst, **kw):
            # what CUDA's kernel checks or needs: a workspace of 320 or 576 values a row (checks.py
            # refuses other widths), rows loaded 16 bytes at a time: a multiple of 8 values in the
            # half-precision caches CUDA serves (the row's padding), whatever the dtype here
            assert dst.shape[-1] in (320, 576) and src_cache.stride(1) % 8 == 0
            return gather(src_cache=src_cache[..., :dst.shape[-1]].contiguous(), dst=dst, **kw)
        ops.gather_mla_context_cache_cpu = first_values
    repeat = args.get("cached_context") or args.get("amx_configuration")
    if repeat:
        # Count the prefills that attend over cached context (with their workspace's width), so the
        # test knows the path ran.
        from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl

        context = MLACommonImpl._compute_prefill_context

        def counted(self, q, cache, attn_metadata, *a, **kw):
            CONTEXT_CALLS.append(attn_metadata.prefill.chunked_context.workspace.shape[-1])
            return context(self, q, cache, attn_metadata, *a, **kw)
        MLACommonImpl._compute_prefill_context = counted
    # CPU_MLA on every CPU unless asked for vLLM's AMX configuration: on one with AMX vLLM would pick
    # AMX_MLA (128-token blocks, chunked prefill and prefix caching on), on one without it picks
    # CPU_MLA anyway; so the same path runs on every CI machine.
    engine = {**({} if args.get("amx_configuration") else {"attention_backend": "CPU_MLA"}), **args.get("engine", {})}
    if ranks > 1:  # one CPU per rank: vLLM binds ranks to NUMA nodes by default, and a small machine has one
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, sorted(os.sched_getaffinity(0))[:ranks])))
    llm = LLM(args["model"], dtype=args.get("dtype", "float32"), enforce_eager=args.get("eager", True),
              gpu_memory_utilization=0.2, max_model_len=args.get("max_model_len", 128), skip_tokenizer_init=True,
              seed=0, distributed_executor_backend="mp" if ranks > 1 else "uni", **parallel, **engine)
    params = SamplingParams(max_tokens=args.get("max_tokens", 12), temperature=0, logprobs=0,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
    reload = args.get("reload")
    if reload:
        before = [list(o.outputs[0].token_ids) for o in outs]
        if reload["via"] == "reload_weights":  # the worker's reload_weights (vLLM's in-place reload)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": reload["model"], "is_checkpoint_format": True})
        elif reload["via"] == "load_weights":
            import functools

            loaded = llm.apply_model(functools.partial(load_weights_from, reload["model"], reload["only"]))
            if not all(loaded):
                raise SystemExit(f"load_weights loaded nothing of {reload['only']}")
        else:
            raise SystemExit(f"reload.via: reload_weights or load_weights, got {reload['via']!r}")
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
    if repeat:  # again: every prompt's blocks are now in the prefix cache
        first, before = outs, len(CONTEXT_CALLS)
        outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
        again = len(CONTEXT_CALLS) - before
        if [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in first]:
            raise SystemExit("a prompt served again from the prefix cache generated other tokens")
    layers = llm.apply_model(qk_layers)  # one list per rank
    widths = llm.apply_model(cache_row_widths)
    key_weights = llm.apply_model(key_weights_read_in_place)
    config = llm.llm_engine.vllm_config
    per_rank = llm.apply_model(key_scalars_and_logit_scales) if args.get("key_scalars") else None
    result = {"key_scalars_by_rank": per_rank, "amx": amx, "model_class": llm.apply_model(model_class)[0], "qk_layers": len(layers[0]),
              "qk_layers_by_rank": layers,
              "block_size": config.cache_config.block_size, "cache_row_widths": sorted(set(sum(widths, []))),
              "key_weights_read_in_place": sum(key_weights, []), "cpu_kernel_calls": len(KERNEL_CALLS),
              "key_scalar_kernel_calls": len(STATISTIC_CALLS),
              "chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
              "prefix_caching": bool(config.cache_config.enable_prefix_caching),
              "context_prefills": len(CONTEXT_CALLS), "context_workspace_widths": sorted(set(CONTEXT_CALLS)),
              "context_prefills_again": again if repeat else None,
              "cached_tokens_again": [o.num_cached_tokens for o in outs] if repeat else None,
              "tokens_before_reload": before if reload else None,
              "tokens": [list(o.outputs[0].token_ids) for o in outs],
              "logprobs": [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]}
    print(RESULT_TAG + json.dumps(result))


if __name__ == "__main__":
    main()
