"""Checkpoints: Hugging Face safetensors loading and Orbax save/restore of converted parameters."""

from jaxmoe.checkpoint.loader import check_checkpoint, load_params
from jaxmoe.checkpoint.orbax_io import is_converted, restore_converted, save_converted
from jaxmoe.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint

__all__ = [
    "CheckpointError",
    "SafetensorsCheckpoint",
    "check_checkpoint",
    "load_params",
    "is_converted",
    "restore_converted",
    "save_converted",
]
