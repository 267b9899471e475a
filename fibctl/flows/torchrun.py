"""torchrun, as `fibctl train --nproc` and `fibctl worker --ddp` start it (`launch_ddp`).

The ranks print their own one-line errors; torchrun's failure report (a traceback of its own
frames, then a table of exit codes) would bury them, so this runs torchrun's `run` and exits
with the ranks' code instead. `python -m torch.distributed.run` by hand is unchanged.
"""

from __future__ import annotations

import logging
import signal
import sys


def exit_code(codes: dict[int, int]) -> int:
    """The group's exit code from its failed ranks' (rank -> code): rank 0's, which reports the
    run, else the first; a rank a signal ended (torch gives -N) as a shell reads it, 128 + N."""
    code = codes[0] if 0 in codes else codes[min(codes)]
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its own lines repeat the ranks'
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        return exit_code({rank: failure.exitcode for rank, failure in e.failures.items()})
    except SignalException as e:  # stopped before or while the ranks started: they are stopped too
        return 128 + signal.Signals(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
