"""The staging folders of exports (``fsdp2d.checkpoint._replace``), as readers see them:
a killed export can leave one in the export folder (see ``_replace``'s docstring)."""

from __future__ import annotations

from pathlib import Path

STAGE_PREFIX = ".fsdp2d-export-"


def interrupted_swap(folder: Path) -> Path | None:
    """The ``.previous`` folder of an export killed inside its swap, if ``folder`` holds
    one with files in it (the folder is then a mix of two exports), else None."""
    for stage in folder.glob(STAGE_PREFIX + "*"):
        previous = stage / ".previous"
        if previous.is_dir() and any(previous.iterdir()):
            return previous
    return None

