"""Safetensors headers and the sharded index of a Hugging Face checkpoint, read and validated without reading
tensor data: offsets inside the data section, sizes that match the shape, supported dtypes, no overlaps.

Torch-free, so that the converter (the base install) and the reference share one reader.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import CloverInputError
from .long_numbers import MAX_SHOWN_NAME, long_integer_reason, shown
from .input_files import SAFETENSORS, WEIGHT_INDEX, open_input, present, read_input_text

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


def read_safetensors_header(path: Path) -> dict[str, SourceTensor]:
    """Parse and validate one safetensors header; raise CloverInputError naming the file and tensor."""
    try:
        with open_input(path, SAFETENSORS) as f:
            size = os.fstat(f.fileno()).st_size
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
    except ValueError:  # an integer of more digits than CPython converts
        raise CloverInputError(path, f"has a corrupt safetensors header ({long_integer_reason(raw)})") from None
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


def read_weight_map(model_dir: Path) -> dict[str, Path] | None:
    """The index's tensor -> file map of a sharded checkpoint (every file checked to exist), or None when the
    checkpoint has no index."""
    index_path = model_dir / INDEX_FILE
    if not present(index_path):
        return None
    text = read_input_text(index_path, WEIGHT_INDEX)
    try:
        weight_map = json.loads(text)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CloverInputError(index_path, f"is not a valid safetensors index ({exc})", field="weight_map") from None
    except ValueError:  # an integer of more digits than CPython converts
        raise CloverInputError(index_path, long_integer_reason(text)) from None
    except RecursionError:
        raise CloverInputError(index_path, "is not a valid safetensors index (JSON nested too deeply)") from None
    by_name: dict[str, Path] = {}
    for tensor_name, file_name in weight_map.items():
        path = _shard_path(model_dir, index_path, tensor_name, file_name)
        if not present(path):  # anything else there is refused when its header is read
            raise CloverInputError(path, f"is named in {INDEX_FILE} (tensor {shown(tensor_name, MAX_SHOWN_NAME)}) "
                                         "but does not exist")
        by_name[tensor_name] = path
    return by_name


def _shard_path(model_dir: Path, index_path: Path, tensor_name: str, file_name: object) -> Path:
    """The file the index places ``tensor_name`` in: a relative path that stays inside the checkpoint folder
    (no absolute path, no ``..``). The file itself may be a symbolic link, as the Hugging Face cache's snapshot
    files are (links into its blobs folder): a link is the user's own file system, the index is the
    checkpoint's."""
    tensor, where = shown(tensor_name, MAX_SHOWN_NAME), shown(file_name, MAX_SHOWN_NAME)
    if not isinstance(file_name, str) or not file_name or "\0" in file_name:
        raise CloverInputError(index_path, f"places tensor {tensor} in {where}, which is not a file name",
                               field="weight_map")
    name = PurePosixPath(file_name)
    if name.is_absolute() or ".." in name.parts:
        raise CloverInputError(index_path, f"places tensor {tensor} in {where}, outside the checkpoint folder: "
                                           "shard names must be paths inside it", field="weight_map")
    return model_dir / name
