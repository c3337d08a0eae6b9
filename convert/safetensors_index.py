"""Index the tensors of a Hugging Face checkpoint from its safetensors headers, without reading tensor data.

Every header is validated against its file (offsets inside the data section, sizes that match the shape,
supported dtypes), so that conversion never starts on a checkpoint it cannot finish.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from clover_ref.errors import CloverInputError
from clover_ref.layout import canonical_name

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype name -> bytes per element, for the dtypes a Clover checkpoint may use.
SUPPORTED_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True)
class SourceTensor:
    """One tensor stored in a safetensors file: where its bytes are and how to read them."""

    name: str  # the name as stored in the file
    path: Path
    dtype: str  # a key of SUPPORTED_DTYPES
    shape: tuple[int, ...]
    data_offset: int  # absolute byte offset of the first element in the file

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return SUPPORTED_DTYPES[self.dtype]


@dataclass
class CheckpointIndex:
    """The text-model tensors of a checkpoint, keyed by their ``model.``-prefixed canonical name."""

    tensors: dict[str, SourceTensor]
    files: list[Path]
    skipped: list[str]  # stored names of vision/MTP tensors that conversion ignores


def read_safetensors_header(path: Path) -> dict[str, SourceTensor]:
    """Parse and validate one safetensors header; raise CloverInputError naming the file and tensor."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CloverInputError(path, "is truncated: shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CloverInputError(path, f"is truncated: its header claims {header_len} bytes but the file "
                                             f"has {size} bytes")
            raw = f.read(header_len)
    except OSError as exc:
        raise CloverInputError(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CloverInputError(path, f"has a corrupt safetensors header ({exc})") from None
    except RecursionError:
        raise CloverInputError(path, "has a corrupt safetensors header (JSON nested too deeply)") from None
    if not isinstance(header, dict):
        raise CloverInputError(path, "has a corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, SourceTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _parse_entry(path, name, entry, data_start, data_size)
    _check_no_overlap(path, tensors, data_start)
    return tensors


def _check_no_overlap(path: Path, tensors: dict[str, SourceTensor], data_start: int) -> None:
    """Tensors' byte ranges must not overlap (the safetensors format lays them end to end): a header whose
    data_offsets overlap would read one tensor's bytes as another's."""
    spans = sorted((t.data_offset - data_start, t.data_offset - data_start + t.n_elements * t.itemsize, name)
                   for name, t in tensors.items())
    for (_, end_a, a), (begin_b, end_b, b) in zip(spans, spans[1:]):
        if begin_b < end_a and end_b > begin_b:
            raise CloverInputError(path, f"tensor '{b}' (data_offsets [{begin_b}, {end_b}]) overlaps tensor '{a}' "
                                         f"(which ends at {end_a}): a corrupt safetensors header")


def _parse_entry(path: Path, name: str, entry: object, data_start: int, data_size: int) -> SourceTensor:
    if not isinstance(entry, dict):
        raise CloverInputError(path, f"tensor '{name}' has a corrupt header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SUPPORTED_DTYPES:
        raise CloverInputError(path, f"tensor '{name}' has dtype {dtype}, which clover-convert does not support "
                                     "(expected BF16, F16 or F32)")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)):
        raise CloverInputError(path, f"tensor '{name}' has a corrupt header entry {entry!r}")
    begin, end = offsets
    if end < begin:
        raise CloverInputError(path, f"tensor '{name}' has data_offsets [{begin}, {end}] out of order")
    if end > data_size:
        raise CloverInputError(path, f"is truncated: tensor '{name}' ends at byte {end} of a {data_size}-byte "
                                     "data section")
    expected = math.prod(shape) * SUPPORTED_DTYPES[dtype]
    if begin < 0 or end - begin != expected:
        raise CloverInputError(path, f"tensor '{name}' occupies {end - begin} bytes, but shape {shape} in {dtype} "
                                     f"needs {expected}")
    return SourceTensor(name=name, path=path, dtype=dtype, shape=tuple(shape), data_offset=data_start + begin)


def weight_files(model_dir: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files of a checkpoint and, when it has an index, the index's tensor -> file map.

    A directory without weights gives an empty list (a config-only checkpoint).
    """
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CloverInputError(index_path, f"is not a valid safetensors index ({exc})",
                                   field="weight_map") from None
        except RecursionError:
            raise CloverInputError(index_path, "is not a valid safetensors index (JSON nested too deeply)") from None
        by_name: dict[str, Path] = {}
        for tensor_name, file_name in weight_map.items():
            path = model_dir / str(file_name)
            if not path.is_file():
                raise CloverInputError(path, f"is named in {INDEX_FILE} (tensor '{tensor_name}') but does not exist")
            by_name[tensor_name] = path
        files = sorted(set(by_name.values()))
        return files, by_name
    single = model_dir / SINGLE_FILE
    if single.is_file():
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
