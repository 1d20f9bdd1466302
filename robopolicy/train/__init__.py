"""Imitation training: one recipe (config) per stage; see trainer.py."""

from robopolicy.train.trainer import TrainConfig, TrainError, TrainResult, train

__all__ = ["TrainConfig", "TrainError", "TrainResult", "train"]
