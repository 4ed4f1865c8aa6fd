"""``python -m fsdp2d.train --config ...``: same as ``fsdp2d train``."""

import sys

from .cli import train

sys.exit(train(sys.argv[1:]))
