"""The 2D bridge: layouts of FSDP shards of TP shards, and conversions to torch DTensor."""

from ._layout import fsdp_layout
from .extensions import (DTensorExtensions, LocalShard, from_dtensor, gather_axes, gather_full, layout_of_spec,
                         to_dtensor)

__all__ = ["fsdp_layout", "DTensorExtensions", "LocalShard", "gather_full", "gather_axes", "to_dtensor",
           "from_dtensor", "layout_of_spec"]
