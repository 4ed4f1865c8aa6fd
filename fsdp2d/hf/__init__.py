"""Hugging Face in and out: every piece of fsdp2d that reads or writes ``transformers``' world.

- :mod:`~fsdp2d.hf.config` and :mod:`~fsdp2d.hf.files`: an HF folder read as untrusted input
  (``config.json`` checked field by field, safetensors files opened only inside the folder).
- :mod:`~fsdp2d.hf.weights`: one name table per architecture (Llama, GPT-2);
  :func:`from_hf` (a whole fsdp2d model on one process) and :func:`load_hf_into` (fill a
  built, parallelized model, each rank reading only its own boxes).
- :mod:`~fsdp2d.hf.export`: :func:`export_hf`, an fsdp2d checkpoint -> an HF folder that
  ``transformers`` loads.
- :mod:`~fsdp2d.hf.tp` and :mod:`~fsdp2d.hf.styles`: :func:`tp_plan` translates the TP plan an
  HF model ships into fsdp2d styles (with ``Conv1D`` styles for GPT-2), so
  ``parallelize_module(hf_model, mesh["tp"], fsdp2d.hf.tp_plan(hf_model))`` works.
- :mod:`~fsdp2d.hf.document`: :func:`document_inputs`, the ``position_ids`` and 4D mask that
  make a transformers model attend within documents only.
- :mod:`~fsdp2d.hf.launch`: the launcher's ``model.init_from`` (not imported here: it needs
  the launcher's config).
"""

from .config import HFError
from .document import document_inputs
from .export import export_hf
from .styles import ColwiseConv1D, DivideAttributes, RowwiseConv1D
from .tp import tp_plan
from .weights import from_hf, load_hf_into

__all__ = ["HFError", "document_inputs", "from_hf", "load_hf_into", "export_hf", "tp_plan", "ColwiseConv1D", "RowwiseConv1D",
           "DivideAttributes"]
