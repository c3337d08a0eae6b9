"""What clover-quantize needs to know about its input before it calls llama.cpp: is it a clover GGUF, which
shards it has, and which of its tensors are already quantized."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader

from clover_common.errors import BadInput
from clover_common.input_files import GGUF, check_input_file, open_input, present
from clover_common.layout import ARCH_SPELLINGS, V1_GGUF_ARCH

from .file_types import is_quantized
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class InputError(BadInput):
    """The input file cannot be quantized; the message names the file and the field."""


@dataclass(frozen=True)
class InputTensor:
    name: str
    shape: tuple[int, ...]          # ne0 first, as ggml and llama.cpp print it
    type: GGMLQuantizationType
    nbytes: int


@dataclass(frozen=True)
class InputModel:
    path: Path                      # the file given (the first shard of a split model)
    shards: tuple[Path, ...]
    tensors: tuple[InputTensor, ...]
    file_type: int | None           # general.file_type

    @property
    def quantized(self) -> list[InputTensor]:
        return [t for t in self.tensors if is_quantized(t.type)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def field_value(reader: GGUFReader, key: str) -> Any:
    """A key's value as gguf-py decodes it (str, int, float or list), or None when it is missing or is not
    valid UTF-8 (callers then report the key as missing, by name)."""
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except UnicodeDecodeError:
        return None


def input_shard_paths(path: Path) -> tuple[Path, ...]:
    """All shards of a split model given its first shard (``name-00001-of-00003.gguf``), else ``(path,)``."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return (path,)
    n = int(m.group("n"))
    if int(m.group("i")) != 1:
        raise InputError(f"{path}: give the first shard of a split model (…-00001-of-{n:05d}.gguf)")
    shards = tuple(path.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1))
    missing = [str(p) for p in shards if not present(p)]
    if missing:
        raise InputError(f"{path}: split model shard(s) missing: {', '.join(missing)}")
    for shard in shards:
        check_input_file(shard, GGUF)
    return shards


def read_input(path: Path) -> InputModel:
    """Read the header(s) of a clover GGUF (no tensor data) that the engine accepts (``check_engine_accepts``).
    Raises InputError for anything else."""
    check_input_file(path, GGUF)
    shards = input_shard_paths(path)
    # the engine's checks first: its parser refuses a damaged file at once, where gguf-py's reader can spin for
    # minutes on a corrupted array length
    check_engine_accepts(path)
    tensors: list[InputTensor] = []
    file_type: int | None = None
    for i, shard in enumerate(shards):
        try:
            with open_input(shard, GGUF) as f:  # what gguf-py maps is the checked file
                reader = GGUFReader(f, "r")  # type: ignore[arg-type]
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise InputError(f"{shard}: not a GGUF file ({' '.join(str(exc).split()) or type(exc).__name__})") from None
        if i == 0:
            arch = field_value(reader, "general.architecture")
            if not isinstance(arch, str):
                raise InputError(f"{shard}: general.architecture is missing: not a llama.cpp model GGUF")
            if arch == V1_GGUF_ARCH:
                raise InputError(f"{shard}: general.architecture is '{arch}', spec v1, which is retired: convert the "
                                 "checkpoint again with clover-convert (spec v2, architecture clover_moe)")
            if arch not in ARCH_SPELLINGS:
                raise InputError(f"{shard}: general.architecture is '{arch}', not one of {', '.join(ARCH_SPELLINGS)}: "
                                 "clover-quantize only quantizes Clover GGUF files (clover-convert makes them)")
            file_type = field_value(reader, "general.file_type")
        for t in reader.tensors:
            tensors.append(InputTensor(t.name, tuple(int(d) for d in t.shape), GGMLQuantizationType(t.tensor_type),
                                       int(t.n_bytes)))
    return InputModel(path, shards, tuple(tensors), file_type)


def check_engine_accepts(path: Path) -> None:
    """The engine's own checks of a GGUF, so clover-quantize refuses what clover-cpp refuses: libclover's checks
    of the clover keys and of the file's size, then llama.cpp's loader with the clover architecture's checks of
    hyperparameters and tensor types (``no_alloc``: no weight is read). Raises InputError with the reason."""
    from clover_native import libclover, loader, bindings

    try:
        libclover.read_model_info(str(path))
        bindings.check_model(path)
    except loader.NativeError as exc:
        raise InputError(str(exc)) from None
