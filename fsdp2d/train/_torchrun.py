"""torchrun as ``fsdp2d train`` launches it: ``torch.distributed.run`` quiet about Ctrl-C.

On SIGINT torchrun logs one warning per worker it signals and dies with a SignalException
traceback; the workers stop on their own (rank 0 prints where the run stopped and how to
continue it, see ``cli.train``), so those lines say nothing and are dropped. Every other
message (a worker failure, a restart) is torchrun's as usual.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

_NOISE = ("death signal", "closing signal", "Got termination signal")


class _DropSignalNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in record.getMessage() for s in _NOISE)


if __name__ == "__main__":
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_DropSignalNoise())
    try:
        main(sys.argv[1:])
    except SignalException as exc:  # Ctrl-C or a SIGTERM: the workers were stopped
        sys.exit(128 + int(exc.sigval))
