"""Parallelism-agnostic reference models and their default tensor-parallel plans."""

from fsdp2d.models.gpt2 import GPT2, GPT2Args
from fsdp2d.models.hf import from_hf, load_hf_into
from fsdp2d.models.llama import Llama, LlamaArgs
from fsdp2d.models.plans import gpt2_tp_plan, llama_tp_plan

__all__ = ["Llama", "LlamaArgs", "GPT2", "GPT2Args", "llama_tp_plan", "gpt2_tp_plan", "from_hf",
           "load_hf_into"]
