"""Training: data, optimizers and schedules, checkpoints, the training loop, plots."""

from .trainer import TrainConfig, load_model, train

__all__ = ["TrainConfig", "load_model", "train"]
