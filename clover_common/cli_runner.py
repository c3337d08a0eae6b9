"""What the four command-line tools share: the one-line error format, exit status 2 for bad input, and the
interrupt and signal statuses.

    def main(argv=None) -> int:
        return cli_runner.run(PROG, lambda: _main(argv))

A ``CloverError`` (errors.py) or an ``OSError`` (a file that cannot be read or written) prints
``PROG: error: MESSAGE`` on one line and exits with 2; argparse's own errors take the same form
(``OneLineParser``). Ctrl-C exits with 130 and SIGTERM/SIGHUP (with ``safe_output.signals_cleanup``) with
128 + the signal. Anything else is a bug: its traceback is kept, with a line asking to report it, exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from . import safe_output
from .errors import BadInput, CloverError

EXIT_BAD_INPUT = 2
EXIT_BUG = 1


def one_line(message: object) -> str:
    return " ".join(str(message).split())


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are BadInput, printed by ``run`` on one line as every other bad input (argparse
    would print the usage first). Parse inside ``run``'s body."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{message} (see --help)")


def run(prog: str, body: Callable[[], int], *, writes_output: bool = False,
        abandon: Callable[[], bool] = lambda: False) -> int:
    """Run a tool's ``body`` and turn what it raises into the exit status and message every tool uses.

    ``writes_output``: the interrupt message says that no partial output is left (the tool writes through
    safe_output). ``abandon``: true when a native call that cannot be stopped is still running; the process then
    exits at once instead of waiting for it."""
    try:
        return body()
    except (KeyboardInterrupt, safe_output.Terminated) as exc:
        status = 130 if isinstance(exc, KeyboardInterrupt) else safe_output.exit_status(exc)
        what = "interrupted" if status == 130 else str(exc)
        if sys.stdout.isatty():  # end a line of streamed output first
            print(file=sys.stderr)
        print(f"{prog}: {what}" + (" (no partial output is left)" if writes_output else ""), file=sys.stderr)
        if abandon():
            sys.stderr.flush()
            os._exit(status)
        return status
    except CloverError as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prog}: error: {where}{one_line(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:  # a bug: keep the traceback
        traceback.print_exc()
        print(f"{prog}: internal error (a bug, not your input): please report it with the command and the output "
              "above", file=sys.stderr)
        return EXIT_BUG
