"""Distributed checkpoints that reshard: save on one mesh, load on any other.

Each rank writes the boxes it owns as safetensors; a JSON index records every tensor's
dtype, global shape and boxes. ``load`` reads, on any mesh (or an unparallelized model),
only the slices each rank needs. ``python -m fsdp2d.checkpoint export CKPT OUT`` writes a
Hugging Face-style full export (``--format hf``: HF names and
``config.json``, loadable by ``transformers``); ``inspect CKPT`` prints a summary.
"""

from ._api import CheckpointManager, export, get_model_state_dict, inspect
from ._hf import export_hf
from ._io import CheckpointError, load, read_index, save

__all__ = ["save", "load", "get_model_state_dict", "CheckpointManager", "CheckpointError", "export", "inspect",
           "read_index", "export_hf"]
