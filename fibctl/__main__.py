"""The `fibctl` program (pyproject's script) and `python -m fibctl`.

The command-line modules take about a second to import; a Ctrl-C in that second exits 130
quietly, as one during a command does, instead of a traceback of whichever import it hit.
"""

import sys


def main() -> None:
    try:
        from fibctl.cli import main as run
    except KeyboardInterrupt:  # nothing has started yet: nothing to stop or record
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
