"""The 2D bridge: layouts of FSDP shards of TP shards, and conversions to torch DTensor."""

from ._layout import fsdp_layout

__all__ = ["fsdp_layout"]
