"""The class every FSDP1 unit is an instance of, below the modules that look units up.

``FullyShardedDataParallel`` (``_wrapper``) subclasses :class:`Unit` and is the only
class that does, so ``isinstance(m, Unit)`` is ``isinstance(m, FullyShardedDataParallel)``.
The state-dict, optimizer and summon code find units through it without importing the
wrapper, which imports them (no import cycle).
"""

from torch import nn


class Unit(nn.Module):
    """Marker base of :class:`~fsdp2d.fsdp1.FullyShardedDataParallel`; no state, no methods."""
