"""The one opener of user-named input files (clover_common/input_files.py; docs/architecture.md, "Input files"):
a fifo swapped in after the check does not block it, a read stops one byte past the cap, text reads as Python's
text mode reads it, and the docs' table holds every kind with its cap. Every tool's file options with special files
in them: tests/convert/test_fuzz.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_common.input_files import (KINDS, InputFileError, InputKind, check_input_dir, present, read_input_bytes,
                                       read_input_text, read_json, size_text)
from clover_dev import REPO_ROOT

# another process renames a fifo and a regular file onto the path in turn, as fast as it can (the file stays a
# little longer, so that the reader also sees it)
SWAPPER = """
import os, sys, time
d = sys.argv[1]
target, fifo, regular = (os.path.join(d, n) for n in ("target", "fifo", "regular"))
while os.getppid() != 1:
    os.mkfifo(fifo)
    os.replace(fifo, target)
    with open(regular, "w") as f:
        f.write("x")
    os.replace(regular, target)
    time.sleep(2e-5)
"""
# the opener reads the path for 2 s: each read gets the file or refuses the fifo
READER = """
import sys, time
from clover_common.input_files import InputFileError, InputKind, read_input_bytes
got = {"read": 0, "refused": 0}
end = time.monotonic() + 2
while time.monotonic() < end:
    try:
        assert read_input_bytes(sys.argv[1], InputKind("test", 10)) == b"x"
        got["read"] += 1
    except InputFileError as exc:
        assert "is a fifo" in str(exc) or "no such file" in str(exc), exc
        got["refused"] += 1
print(got["read"], got["refused"])
"""


def test_a_fifo_swapped_in_after_the_check_never_blocks(tmp_path: Path) -> None:
    """The check before the open cannot see a fifo renamed onto the path just after it: the open does not block
    (O_NONBLOCK) and the check on the opened file refuses it. Opened without O_NONBLOCK, the reader waits for a
    writer forever within a few thousand reads."""
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(tmp_path)], start_new_session=True)
    try:
        while not present(tmp_path / "target"):
            assert swapper.poll() is None, "the swapper failed"
            time.sleep(0.001)
        done = subprocess.run([sys.executable, "-c", READER, str(tmp_path / "target")], capture_output=True,
                              text=True, timeout=30, cwd=REPO_ROOT)
    finally:
        os.killpg(swapper.pid, signal.SIGKILL)
        swapper.wait()
    assert done.returncode == 0, done.stderr
    read, refused = map(int, done.stdout.split())
    assert read > 0 and refused > 0, (read, refused)  # both won the race, many times


def test_a_read_stops_one_byte_past_the_cap(tmp_path: Path) -> None:
    """A file over the cap is refused by its size; one whose size says nothing (a /proc file reports 0 bytes) is
    read up to the cap and one byte more, then refused."""
    kind = InputKind("test", 10)
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert read_input_bytes(path, kind) == b"0123456789"
    path.write_bytes(b"0123456789a")
    with pytest.raises(InputFileError, match=r"f: is 11 bytes; test files may have at most 10 bytes$"):
        read_input_bytes(path, kind)
    with pytest.raises(InputFileError, match="status: grew while it was read, past the 10 bytes test files may have"):
        read_input_bytes("/proc/self/status", kind)
    os.truncate(path, 3 * 2**30)  # sparse
    with pytest.raises(InputFileError, match=r"is 3 GiB \(3221225472 bytes\); test files may have at most 10 bytes"):
        read_input_bytes(path, kind, "--opt")


def test_text_reads_as_text_mode(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes("a\r\nb\rc\né".encode())
    assert read_input_text(path, InputKind("test", 100)) == path.read_text(encoding="utf-8")
    path.write_bytes(b"ab\xff")
    with pytest.raises(InputFileError, match=r"--grammar-file .*/t: is not UTF-8 text \(byte 2\)$"):
        read_input_text(path, InputKind("test", 100), "--grammar-file")
    path.write_bytes(b"[" * 100_000)
    with pytest.raises(InputFileError, match="nests JSON arrays or objects too deeply"):
        read_json(path)


def test_what_a_path_is(tmp_path: Path) -> None:
    """The reasons, for a file and for a folder; a link that leads nowhere is there (an optional file under that
    name is refused, not skipped)."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("{}")
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "loop").symlink_to("loop")
    kind = InputKind("test", 10)
    for name, says in (("fifo", "is a fifo (named pipe), not a regular file"), ("dir", "is a directory, not a file"),
                       ("dangling", "is a symbolic link that leads nowhere (a missing target)"),
                       ("loop", "is a symbolic link that leads nowhere (a loop)"), ("missing", "no such file"),
                       ("file/x", "no such file (a part of the path is not a directory)")):
        with pytest.raises(InputFileError) as err:
            read_json(tmp_path / name, kind, "--metadata")
        assert str(err.value) == f"--metadata {tmp_path / name}: {says}"
        assert err.value.reason == says and err.value.path == str(tmp_path / name)
    with pytest.raises(InputFileError, match="^/dev/zero: is a character device, not a regular file$"):
        read_input_bytes("/dev/zero", kind)
    assert present(tmp_path / "dangling") and not present(tmp_path / "missing")
    for name, says in (("fifo", "is a fifo (named pipe), not a directory"), ("file", "is a file, not a directory"),
                       ("missing", "no such directory")):
        with pytest.raises(InputFileError, match=re.escape(f"{tmp_path / name}: {says} (expected a checkpoint)")):
            check_input_dir(tmp_path / name, "a checkpoint")
    check_input_dir(tmp_path / "dir", "a checkpoint")


def test_the_docs_table_holds_every_kind() -> None:
    """docs/architecture.md, "Input files": one row per kind, with its cap."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Input files", 1)[1].split("\n## ", 1)[0]
    rows = {cells[0]: cells[2] for line in section.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]] if cells[0] not in ("kind", "---")}
    assert rows == {kind.name: size_text(kind.max_bytes) if kind.max_bytes else "none" for kind in KINDS}


def test_a_chat_load_refuses_what_is_no_file(tmp_path: Path) -> None:
    """`clover-cpp chat`'s /load FILE (clover_cpp.session.read) opens through the same opener: a SessionError line,
    and the chat goes on."""
    from clover_cpp import session

    os.mkfifo(tmp_path / "fifo")
    for path, says in ((tmp_path / "fifo", "is a fifo (named pipe), not a regular file"),
                       (Path("/dev/zero"), "is a character device, not a regular file"),
                       (tmp_path, "is a directory, not a file")):
        with pytest.raises(session.SessionError, match=re.escape(f"{path}: cannot read: {says}")):
            session.read(path, {}, 64, 100, ("ar",))
