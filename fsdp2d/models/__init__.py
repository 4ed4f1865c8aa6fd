"""Parallelism-agnostic reference models and their default tensor-parallel plans.

``from_hf`` and ``load_hf_into`` (DESIGN's public API names them here) live in :mod:`fsdp2d.hf`
with the rest of the Hugging Face code. They are looked up on first use (PEP 562): ``fsdp2d.hf``
builds on these models, so importing it here would make ``import fsdp2d.hf`` re-enter itself.
"""

from fsdp2d.models.document import document_ids, document_mask, document_positions
from fsdp2d.models.gpt2 import GPT2, GPT2Args
from fsdp2d.models.llama import Llama, LlamaArgs
from fsdp2d.models.tp_plans import gpt2_tp_plan, llama_tp_plan

__all__ = ["Llama", "LlamaArgs", "GPT2", "GPT2Args", "llama_tp_plan", "gpt2_tp_plan", "from_hf", "load_hf_into",
           "document_ids", "document_mask", "document_positions"]


def __getattr__(name: str):
    if name in ("from_hf", "load_hf_into"):
        from fsdp2d.hf import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'fsdp2d.models' has no attribute {name!r}")
