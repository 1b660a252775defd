"""qkmla's torchtitan configs: ``--module qkmla.integrations.torchtitan --config <name>``.

Each config trains one of qkmla's DeepSeek-V3-shaped flavors (``flavors.py``: DeepSeek-V3's router,
latent norms that export, a byte vocabulary) on the Shakespeare embedded in qkmla, with qkmla's byte
tokenizer and local loader (``data.py``): nothing is downloaded and no tokenizer file is read.
Validation runs on the held-out plays.

    name                     flavor  attention
    qkmla_cpu                cpu     plain DeepSeek-V3 MLA, max logits measured
    qkmla_cpu_qk_norm        cpu     QK norm (RMS blockwise, the paper's method)
    qkmla_cpu_qk_clip        cpu     QK-Clip, tau 100 (clipped after each optimizer step)
    qkmla_h200 / _qk_norm / _qk_clip   h200 (1.9B parameters; one H100/H200)

Every config logs each layer's max attention logit (``max_logit_metrics``). The ``cpu`` configs use
:class:`~.inner.DenseMaskAttention` (FlexAttention has no CPU backward) and no CUDA graphs; the
``h200`` ones FlexAttention, bfloat16 and ``torch.compile``. Any of it can be changed on the command
line as with torchtitan's own configs, e.g. another norm with ``--override.imports
'qkmla.integrations.torchtitan.overrides.qk_norm={"kind": "l2"}'
qkmla.integrations.torchtitan.overrides.max_logit_metrics`` (the list replaces the config's).
"""

from __future__ import annotations

from .versions import check_torchtitan

check_torchtitan()

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import (LRSchedulersContainer, default_adamw,  # noqa: E402
                                              register_moe_load_balancing_hook)
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig, derive  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from .data import ByteTokenizer, LocalTextDataLoader  # noqa: E402
from .flavors import VOCAB, model_config  # noqa: E402
from .inner import DenseMaskAttention  # noqa: E402

_OVERRIDES = "qkmla.integrations.torchtitan.overrides."
ARMS = {
    "plain": [_OVERRIDES + "max_logits", _OVERRIDES + "max_logit_metrics"],
    "qk_norm": [_OVERRIDES + "qk_norm", _OVERRIDES + "max_logit_metrics"],
    "qk_clip": [_OVERRIDES + "qk_clip", _OVERRIDES + "qk_clip_optimizer", _OVERRIDES + "max_logit_metrics"],
}


def model_spec(flavor: str) -> ModelSpec:
    """torchtitan's bundle for a qkmla flavor: DeepSeek-V3's parallelize and pipeline functions; no
    state-dict adapter (torchtitan's would not know qkmla's parameters: ``checkpoint.export_hf``
    writes the Hugging Face checkpoint)."""
    config = model_config(flavor)
    if flavor == "cpu":
        for layer in config.layers:
            layer.attention.inner_attention = derive(layer.attention.inner_attention, DenseMaskAttention.Config)
    return ModelSpec(name="qkmla_deepseek_v3", flavor=flavor, model=config, parallelize_fn=parallelize_deepseekv3,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=register_moe_load_balancing_hook,
                     state_dict_adapter=None)


def _config(flavor: str, arm: str) -> Trainer.Config:
    cpu = flavor == "cpu"
    seq_len, batch = (256, 8) if cpu else (4096, 4)
    data = dict(dataset="shakespeare")
    config = Trainer.Config(
        model_spec=model_spec(flavor),
        hf_assets_path="",  # the byte tokenizer reads no file
        tokenizer=ByteTokenizer.Config(),
        dataloader=LocalTextDataLoader.Config(split="train", **data),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        metrics=MetricsProcessor.Config(log_freq=1 if cpu else 10),
        optimizer=default_adamw(lr=1e-3 if cpu else 3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5 if cpu else 100, decay_ratio=0.8,
                                                  decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=20 if cpu else 1000,
                                dtype="float32", disable_cuda_graphs=cpu,
                                mixed_precision_param="float32" if cpu else "bfloat16"),
        # torchtitan 0.3.0's default backend (spmd_types) stops in fully_shard with torch 2.13.0 once a mesh is
        # built, for its own debug model too (docs/torchtitan.md); full_dtensor trains
        parallelism=ParallelismConfig(expert_parallel_degree=1, spmd_backend="full_dtensor"),
        checkpoint=CheckpointManager.Config(interval=500, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        compile=CompileConfig(enable=not cpu),
        validator=Validator.Config(enable=True, freq=10 if cpu else 200, steps=4 if cpu else 20,
                                   dataloader=LocalTextDataLoader.Config(split="val", infinite=False, **data)),
    )
    config.override.imports = list(ARMS[arm])
    return config


def qkmla_cpu() -> Trainer.Config:
    return _config("cpu", "plain")


def qkmla_cpu_qk_norm() -> Trainer.Config:
    return _config("cpu", "qk_norm")


def qkmla_cpu_qk_clip() -> Trainer.Config:
    return _config("cpu", "qk_clip")


def qkmla_h200() -> Trainer.Config:
    return _config("h200", "plain")


def qkmla_h200_qk_norm() -> Trainer.Config:
    return _config("h200", "qk_norm")


def qkmla_h200_qk_clip() -> Trainer.Config:
    return _config("h200", "qk_clip")
