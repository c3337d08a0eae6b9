"""Outputs that are never destructive, shared by clover-convert and clover-quantize.

- ``check_output(path, inputs)``: an output must be a regular file or absent, and must not be one of the
  inputs; symlinks are resolved before deciding (a link to a regular file is written through: the target
  is replaced, the link stays). Returns the path to publish onto.
- Temporary directories are named ``.{stem}.pid{PID}.XXXXXXXX{suffix}`` next to the output:
  ``make_temp_dir`` registers them, SIGTERM/SIGHUP remove the registered ones (``signals_cleanup``), and
  ``sweep_stale`` removes those of the same output that a killed run (SIGKILL, power loss) left behind.
- ``deferred_signals()`` holds SIGTERM/SIGHUP/SIGINT back while the files are renamed into place, so an
  output is published whole or not at all.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from .errors import CloverError

STALE_UNTAGGED_S = 3600  # a temporary directory without a pid tag (older versions) is stale after an hour
_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)

_temps: set[Path] = set()
_lock = threading.Lock()
_deferred = 0
_pending: list[int] = []


class UnsafeOutput(CloverError):
    """The output path would destroy something (a device, a directory, an input); the message names it."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt so that ``finally`` blocks clean up."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


# ---------------------------------------------------------------------------------------------- checks
def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(path: Path, inputs: Iterable[Path] = ()) -> Path:
    """Refuse an output that is not a regular file (a device, a fifo, a directory, a socket) or that is one
    of ``inputs`` (same file, through any symlink or hard link). Returns where to publish: ``path`` itself,
    or the regular file a symlink points to (so the link is kept)."""
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UnsafeOutput(f"{path}: the output cannot be checked ({exc.strerror or exc})") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a fifo" if stat.S_ISFIFO(st.st_mode) else
                    "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            via = f" (through the link to {target})" if target != Path(os.path.abspath(path)) else ""
            raise UnsafeOutput(f"{path}: the output is {kind}{via}; refusing to replace it (give a regular file "
                               "name)")
        for inp in inputs:
            try:
                if _same(st, os.stat(inp)):
                    raise UnsafeOutput(f"{path}: the output is the input {inp}; refusing to overwrite it")
            except OSError:
                continue
    return target if os.path.islink(path) else path


# ---------------------------------------------------------------------------------------------- temporaries
def _temp_pattern(stem: str, suffix: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{stem}.") + r"(?:pid(\d+)\.)?[a-z0-9_]{8}" + re.escape(suffix))


def make_temp_dir(directory: Path, stem: str, suffix: str) -> Path:
    """A new hidden directory ``.{stem}.pid{PID}.XXXXXXXX{suffix}`` in ``directory``, registered for removal on
    SIGTERM/SIGHUP (``forget_temp`` once it is gone)."""
    path = Path(tempfile.mkdtemp(prefix=f".{stem}.pid{os.getpid()}.", suffix=suffix, dir=directory))
    with _lock:
        _temps.add(path)
    return path


def forget_temp(path: Path) -> None:
    with _lock:
        _temps.discard(path)


def remove_temp(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    forget_temp(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def sweep_stale(directory: Path, stem: str, suffix: str) -> list[Path]:
    """Remove the temporary directories of this output that a killed run left in ``directory``: those whose
    process is gone (or, without a pid tag, untouched for an hour). A live run's directory is kept."""
    pattern = _temp_pattern(stem, suffix)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        if m.group(1) is not None:
            pid = int(m.group(1))
            if pid == os.getpid() or _alive(pid):
                continue
        else:
            try:
                if time.time() - entry.stat(follow_symlinks=False).st_mtime < STALE_UNTAGGED_S:
                    continue
            except OSError:
                continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


# ---------------------------------------------------------------------------------------------- signals
def _on_signal(signum: int, _frame: FrameType | None) -> None:
    if _deferred:
        _pending.append(signum)
        return
    raise Terminated(signum)


def cleanup_now() -> None:
    """Remove every registered temporary directory (what SIGTERM/SIGHUP do on the way out)."""
    with _lock:
        temps = list(_temps)
        _temps.clear()
    for path in temps:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def signals_cleanup() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Terminated`` in the main thread, so the work unwinds and its temporaries
    are removed; whatever is still registered on the way out is removed too. Only from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _on_signal) for s in _SIGNALS}
    try:
        yield
    finally:
        try:
            cleanup_now()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGTERM/SIGHUP (``Terminated``) and SIGINT (KeyboardInterrupt) back inside the block; they act
    when it ends."""
    global _deferred
    main = threading.current_thread() is threading.main_thread()
    old_int = signal.signal(signal.SIGINT, _on_signal) if main else None
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)
        if not _deferred and _pending:
            signum = _pending[0]
            _pending.clear()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(signum)


def exit_status(exc: Terminated) -> int:
    return 128 + exc.signum
