"""Checkpoints: Hugging Face safetensors loading (block-wise FP8 ones dequantized on load) and Orbax
save/restore of converted parameters."""

from jaxmoe.checkpoint.fp8 import dequantize_checkpoint, quantize_checkpoint
from jaxmoe.checkpoint.loader import check_checkpoint, load_params
from jaxmoe.checkpoint.orbax_io import is_converted, restore_converted, save_converted
from jaxmoe.checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint

__all__ = [
    "CheckpointError",
    "SafetensorsCheckpoint",
    "check_checkpoint",
    "dequantize_checkpoint",
    "quantize_checkpoint",
    "load_params",
    "is_converted",
    "restore_converted",
    "save_converted",
]
