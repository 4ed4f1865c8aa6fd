"""Distributed checkpoints that reshard: save on one mesh, load on any other.

Each rank writes the boxes it owns as safetensors (with their offsets and sha256 in the
file's header); a JSON index records every tensor's dtype, global shape and layout over
the mesh, so its size does not grow with the world size. ``load`` reads, on any mesh (or
an unparallelized model), only the files and slices each rank needs.
``python -m fsdp2d.checkpoint export CKPT OUT`` writes a Hugging Face-style full export
(``--format hf``: HF names and ``config.json``, loadable by ``transformers``; in code
:func:`fsdp2d.hf.export_hf`);
``inspect CKPT`` prints a summary.
"""

from ._api import CheckpointManager, export, get_model_state_dict, inspect
from ._io import CheckpointError, load, read_index, save

__all__ = ["save", "load", "get_model_state_dict", "CheckpointManager", "CheckpointError", "export", "inspect",
           "read_index"]


def __getattr__(name: str):
    if name == "export_hf":  # deprecated alias (PEP 562: fsdp2d.hf imports this package)
        import warnings

        from ..hf.export import export_hf

        warnings.warn("fsdp2d.checkpoint.export_hf is deprecated: use fsdp2d.hf.export_hf", FutureWarning,
                      stacklevel=2)
        return export_hf
    raise AttributeError(f"module 'fsdp2d.checkpoint' has no attribute {name!r}")
