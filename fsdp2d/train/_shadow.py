"""A folder named ``fsdp2d`` in the current directory that hides the installed package.

``python -m ...`` (and torchrun's ``-m``) put the current directory first on ``sys.path``.
Run from the folder that holds a clone named ``fsdp2d``, ``import fsdp2d`` finds the clone's
root (no ``__init__.py`` there) and makes it a *namespace package* before the editable
install's finder is asked; submodules (``fsdp2d.train``) still load from the real package,
so the run gets far, then fails on every rank with ``module 'fsdp2d' has no attribute
'init_device_mesh'``. The entry points check for it first and say so in one line (exit 2).
``fsdp2d train`` itself is immune: it starts torchrun and the workers with
``PYTHONSAFEPATH=1`` (no current directory on ``sys.path``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["shadowing_folder", "exit_if_shadowed"]


def shadowing_folder() -> str | None:
    """The folder that ``import fsdp2d`` took instead of the package, or None."""
    import fsdp2d

    if getattr(fsdp2d, "__file__", None) is not None:  # a regular package: the real one
        return None
    return ", ".join(list(getattr(fsdp2d, "__path__", []))) or "?"


def exit_if_shadowed() -> None:
    folder = shadowing_folder()
    if folder is None:
        return
    if os.environ.get("RANK", "0") == "0":  # every rank exits; one says why
        print(f"error: the folder {folder} (in the current directory) hides the installed fsdp2d package (Python "
              f"imports it as a namespace package): run from another directory, e.g. cd {folder}",
              file=sys.stderr, flush=True)
    sys.exit(2)
