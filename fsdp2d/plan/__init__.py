"""``fsdp2d plan``: dry-run one rank of a training job under torch's fake process group.

See :mod:`fsdp2d.plan._dryrun` (what runs), :mod:`fsdp2d.plan._probe` (what is
measured), :mod:`fsdp2d.plan.estimate` (the GPU table and the roofline) and
:mod:`fsdp2d.plan.cli` (the command).
"""

from ._dryrun import dry_run, measure_step
from ._probe import StepProbe

__all__ = ["dry_run", "measure_step", "StepProbe"]
