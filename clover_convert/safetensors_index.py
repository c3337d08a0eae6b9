"""Index the tensors of a Hugging Face checkpoint from its safetensors headers, without reading tensor data.

Every header is validated against its file (offsets inside the data section, sizes that match the shape,
supported dtypes), so that conversion never starts on a checkpoint it cannot finish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from clover_common.errors import CloverInputError
from clover_common.input_files import present
from clover_common.layout import canonical_name
from clover_common.safetensors_header import (INDEX_FILE, SINGLE_FILE, SUPPORTED_DTYPES, SourceTensor,  # noqa: F401
                                           read_safetensors_header, read_weight_map)

log = logging.getLogger(__name__)


@dataclass
class CheckpointIndex:
    """The text-model tensors of a checkpoint, keyed by their ``model.``-prefixed canonical name."""

    tensors: dict[str, SourceTensor]
    files: list[Path]
    skipped: list[str]  # stored names of vision/MTP tensors that conversion ignores


def weight_files(model_dir: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files of a checkpoint and, when it has an index, the index's tensor -> file map.

    A directory without weights gives an empty list (a config-only checkpoint).
    """
    by_name = read_weight_map(model_dir)
    if by_name is not None:
        files = sorted(set(by_name.values()))
        return files, by_name
    single = model_dir / SINGLE_FILE
    if present(single):  # whatever is there: refused unless a regular file, when its header is read
        return [single], None
    return sorted(model_dir.glob("model*.safetensors")), None


def index_checkpoint(model_dir: Path) -> CheckpointIndex:
    """Read every header and map canonical names to tensors; vision and MTP tensors are skipped."""
    files, index_map = weight_files(model_dir)
    stored: dict[str, SourceTensor] = {}
    for path in files:
        for name, tensor in read_safetensors_header(path).items():
            if name in stored:
                raise CloverInputError(path, f"holds tensor '{name}', which {stored[name].path.name} holds too")
            stored[name] = tensor
    if index_map is not None:
        _check_index_agrees(model_dir / INDEX_FILE, index_map, stored)
    tensors: dict[str, SourceTensor] = {}
    skipped: list[str] = []
    for name, tensor in stored.items():
        canonical = canonical_name(name)
        if canonical is None:
            skipped.append(name)
            continue
        if canonical in tensors:
            raise CloverInputError(tensor.path, f"holds tensor '{name}', which duplicates "
                                                f"'{tensors[canonical].name}'")
        tensors[canonical] = tensor
    return CheckpointIndex(tensors=tensors, files=files, skipped=skipped)


def _check_index_agrees(index_path: Path, index_map: dict[str, Path], stored: dict[str, SourceTensor]) -> None:
    for name, path in index_map.items():
        tensor = stored.get(name)
        if tensor is None or tensor.path != path:
            raise CloverInputError(index_path, f"places tensor '{name}' in {path.name}, but that file does not "
                                               "hold it")
    for name, tensor in stored.items():
        if name not in index_map:
            raise CloverInputError(tensor.path, f"holds tensor '{name}', which {INDEX_FILE} does not list")
