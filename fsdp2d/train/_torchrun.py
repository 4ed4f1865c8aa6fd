"""torchrun as ``fsdp2d train`` launches it: ``torch.distributed.run``, quiet.

* On SIGINT torchrun logs one warning per worker it signals and dies with a SignalException
  traceback; the workers stop on their own (rank 0 prints where the run stopped and how to
  continue it, see ``cli.train``), so those lines say nothing and are dropped.
* When a worker fails, torchrun logs a line per worker and raises ``ChildFailedError``,
  whose traceback and report run to 25-140 lines. The workers have already said what went
  wrong (:mod:`fsdp2d.train.failure`): the log lines are dropped, the report goes to the
  run folder's ``logs/torchrun.log`` when no worker explained itself, and this process
  prints the one line and exits with the worker's code (2: refused, 1: a bug or a crash).

Every other message (a restart under ``--max-restarts``) is torchrun's as usual.
"""

from __future__ import annotations

import logging
import os
import sys

_NOISE = ("death signal", "closing signal", "Got termination signal", "failed (exitcode:")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in record.getMessage() for s in _NOISE)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .failure import RUN_DIR_ENV, child_failed

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_DropNoise())
    try:
        run(parse_args(argv))
    except SignalException as exc:  # Ctrl-C or a SIGTERM: the workers were stopped
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return child_failed(exc, os.environ.get(RUN_DIR_ENV))
    return 0


if __name__ == "__main__":
    from ._shadow import exit_if_shadowed

    exit_if_shadowed()
    sys.exit(main(sys.argv[1:]))
