"""Output file names and atomic publication.

The GGUF (or its shards) is written into a hidden temporary directory inside the output directory and
renamed into place only after every byte is written; on any failure the temporary directory is removed,
so no partial output is ever left behind.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

from gguf import fill_templated_filename
from gguf.gguf_writer import SHARD_NAME_FORMAT

from clover_common import safe_output
from clover_common.errors import CloverError, CloverInputError

TEMP_SUFFIX = ".partial"


class OutputError(CloverError):
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


def output_shard_paths(path: Path, shard_count: int) -> list[Path]:
    """llama.cpp's shard names: ``{stem}-00001-of-0000N.gguf`` (one shard keeps the plain name)."""
    if shard_count == 1:
        return [path]
    return [path.with_name(SHARD_NAME_FORMAT.format(path.stem, i + 1, shard_count)) for i in range(shard_count)]


def check_outputs(paths: Sequence[Path], inputs: Iterable[Path]) -> list[Path]:
    """Each output must be a regular file or absent and none of the inputs (symlinks resolved): a device such
    as /dev/null, a directory or the checkpoint itself is refused. Returns the paths to publish onto."""
    inputs = list(inputs)
    targets = []
    for path in paths:
        try:
            targets.append(safe_output.check_output(path, inputs))
        except safe_output.UnsafeOutput as exc:
            raise OutputError(path, str(exc).removeprefix(f"{path}: ")) from None
    return targets


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OutputError(directory, f"has {free / 2**30:.2f} GiB free, but the output needs "
                                     f"{needed / 2**30:.2f} GiB")


def make_temp_dir(directory: Path, stem: str) -> Path:
    """A new hidden directory ``.{stem}.pid{PID}.XXXXXXXX.partial`` inside ``directory`` (same file system as
    the output), removed on SIGTERM/SIGHUP; stale ones of the same output are swept first."""
    safe_output.sweep_stale(directory, stem, TEMP_SUFFIX)
    return safe_output.make_temp_dir(directory, stem, TEMP_SUFFIX)


class AtomicOutput:
    """A temporary directory next to the final path; ``publish`` renames its files into place, together with the
    companions (files of the same directory written beside it, such as a block-diffusion sidecar): all or none."""

    def __init__(self, final_path: Path, inputs: Iterable[Path] = ()) -> None:
        self.final_path = final_path
        self.inputs = list(inputs)
        directory = final_path.parent
        if not directory.is_dir():
            raise OutputError(directory, "the output directory does not exist")
        try:
            self._temp_dir = make_temp_dir(directory, final_path.stem)
        except OSError as exc:
            raise OutputError(directory, f"the output directory cannot be written ({exc.strerror or exc})") from None
        self._published = False
        self._companions: list[Path] = []

    def companion(self, final: Path) -> Path:
        """The temporary path of another file to publish with this output, at ``final`` (same directory)."""
        assert final.parent == self.final_path.parent, final
        check_outputs([final], self.inputs)
        self._companions.append(final)
        return self._temp_dir / final.name

    @property
    def temp_path(self) -> Path:
        """The path to hand to GGUFWriter; shard names derive from it as from the final path."""
        return self._temp_dir / self.final_path.name

    def publish(self, shard_count: int) -> list[Path]:
        finals = output_shard_paths(self.final_path, shard_count)
        temps = output_shard_paths(self.temp_path, shard_count) + [self._temp_dir / c.name for c in self._companions]
        targets = check_outputs(finals + self._companions, self.inputs)  # again: a path may have changed meanwhile
        with safe_output.deferred_signals():  # all files or none
            for temp, target in zip(temps, targets):
                os.replace(temp, target)
            self._published = True
        self._cleanup()
        return finals + self._companions

    def _cleanup(self) -> None:
        safe_output.remove_temp(self._temp_dir)

    def __enter__(self) -> "AtomicOutput":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._published:
            self._cleanup()
