"""Scratch directories that live as long as a test module, not as long as the test session.

pytest keeps every ``tmp_path_factory.mktemp`` directory until the session ends, and keeps the last sessions' too.
The module fixtures here convert checkpoints of up to 1.4 GB (the ``mid`` preset at f32), so keeping them all
made one run hold about 15 GB of scratch. A module fixture takes ``module_tmp`` instead (tests/conftest.py): its
directories go when the module's tests are done, so a run holds one module's files at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MkTemp = Callable[[str], Path]


@contextmanager
def scratch_dirs(factory: pytest.TempPathFactory) -> Iterator[MkTemp]:
    """``mktemp(name)`` makes a numbered directory under the session's base; all of them go on exit."""
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(factory.mktemp(name))
        return made[-1]

    try:
        yield mktemp
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
