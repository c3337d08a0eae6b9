"""Scratch directories that live as long as a test module, not as long as the test session.

pytest keeps every ``tmp_path_factory.mktemp`` directory until the session ends, and keeps the last sessions' too.
The tests' module fixtures convert checkpoints of up to 1.4 GB (the ``mid`` preset at f32), so keeping them all
made one run hold about 15 GB of scratch. A module fixture takes ``module_tmp`` instead (tests/conftest.py): its
directories go when the module's tests are done, so a run holds one module's files at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

MkTemp = Callable[[str], Path]
