"""``python -m fsdp2d.train --config ...``: same as ``fsdp2d train``."""

import sys

from ._shadow import exit_if_shadowed

exit_if_shadowed()  # before anything reaches for fsdp2d's top-level names

from .cli import train  # noqa: E402

sys.exit(train(sys.argv[1:]))
