"""Output file names and atomic publication.

The GGUF (or its shards) is written into a hidden temporary directory inside the output directory and
renamed into place only after every byte is written; on any failure the temporary directory is removed,
so no partial output is ever left behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from gguf import fill_templated_filename
from gguf.gguf_writer import SHARD_NAME_FORMAT

from clover_ref.errors import CloverInputError


class OutputError(Exception):
    """The output cannot be written (directory missing or read-only, disk full); the message names the path."""

    def __init__(self, path: Path, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


def resolve_output_path(model_dir: Path, outfile: Path | None, default_stem: str, type_label: str) -> Path:
    """llama.cpp's rules: no --outfile writes into the model directory, a directory gets the default name,
    and a file name may use the ``{ftype}``/``{outtype}`` templates."""
    target = outfile if outfile is not None else model_dir
    if target.is_dir():
        return target / f"{default_stem}.gguf"
    try:
        name = fill_templated_filename(target.name, type_label)
    except (KeyError, IndexError, ValueError) as exc:
        raise CloverInputError(target, f"is not a valid output file name template ({exc})") from None
    return target.with_name(name)


def shard_paths(path: Path, shard_count: int) -> list[Path]:
    """llama.cpp's shard names: ``{stem}-00001-of-0000N.gguf`` (one shard keeps the plain name)."""
    if shard_count == 1:
        return [path]
    return [path.with_name(SHARD_NAME_FORMAT.format(path.stem, i + 1, shard_count)) for i in range(shard_count)]


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OutputError(directory, f"has {free / 2**30:.2f} GiB free, but the output needs "
                                     f"{needed / 2**30:.2f} GiB")


def make_temp_dir(directory: Path, stem: str) -> Path:
    """A new hidden directory ``.{stem}.XXXX.partial`` inside ``directory`` (same file system as the output)."""
    return Path(tempfile.mkdtemp(prefix=f".{stem}.", suffix=".partial", dir=directory))


class AtomicOutput:
    """A temporary directory next to the final path; ``publish`` renames its files into place."""

    def __init__(self, final_path: Path) -> None:
        self.final_path = final_path
        directory = final_path.parent
        if not directory.is_dir():
            raise OutputError(directory, "the output directory does not exist")
        try:
            self._temp_dir = make_temp_dir(directory, final_path.stem)
        except OSError as exc:
            raise OutputError(directory, f"the output directory cannot be written ({exc.strerror or exc})") from None
        self._published = False

    @property
    def temp_path(self) -> Path:
        """The path to hand to GGUFWriter; shard names derive from it as from the final path."""
        return self._temp_dir / self.final_path.name

    def publish(self, shard_count: int) -> list[Path]:
        finals = shard_paths(self.final_path, shard_count)
        for temp, final in zip(shard_paths(self.temp_path, shard_count), finals):
            os.replace(temp, final)
        self._published = True
        self._cleanup()
        return finals

    def _cleanup(self) -> None:
        shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> "AtomicOutput":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._published:
            self._cleanup()
