"""Reading and writing Clover weights in the Hugging Face format: safetensors, single or sharded."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from clover_common.config import CloverConfig
from clover_common.errors import CloverInputError
from clover_common.input_files import present
from clover_common.layout import (CONV_RIGHT, canonical_name, check_conv_right_shape, is_v1_tensor,
                                  normalize_conv_right, tensor_shapes)
from clover_common.safetensors_header import INDEX_FILE, SINGLE_FILE, read_safetensors_header, read_weight_map

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_files(model_dir: Path) -> dict[str, Path]:
    """Map every stored tensor name to the safetensors file that holds it, checking that the files exist."""
    by_name = read_weight_map(model_dir)
    if by_name is not None:
        return by_name
    single = model_dir / SINGLE_FILE
    if not present(single):
        raise CloverInputError(model_dir, f"holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    return {name: single for name in read_header(single)}


# The tensors of a safetensors header, validated against the file (the converter's reader).
read_header = read_safetensors_header


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, str, Path]]:
    """Yield (canonical name, stored name, file) for every text-model tensor; vision/MTP tensors are skipped
    with a warning (spec section 2)."""
    skipped: list[str] = []
    for stored, path in shard_files(model_dir).items():
        name = canonical_name(stored)
        if name is not None:
            yield name, stored, path
        else:
            skipped.append(stored)
    if skipped:
        warnings.warn(f"{model_dir}: ignoring {len(skipped)} vision/MTP tensors (e.g. '{skipped[0]}')", stacklevel=2)


def load_state_dict(model_dir: str | Path, config: CloverConfig, conv_right_order: str = "cd"
                    ) -> dict[str, torch.Tensor]:
    """Load all tensors as float32, fusing per-expert matrices into the stacked layout the model uses.
    conv_right_weight of any accepted rank becomes [conv_dim, K_r] (``conv_right_order``: spec 2.3).

    Every expected tensor must be present with the shape the config implies; any other tensor is an error.
    """
    model_dir = Path(model_dir)
    per_expert = tensor_shapes(config, fused_experts=False)
    fused = tensor_shapes(config, fused_experts=True)
    raw: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    for name, stored, path in iter_tensors(model_dir):
        if path not in handles:
            read_header(path)
            try:
                handles[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises SafetensorError for inconsistent headers
                raise CloverInputError(path, f"is not a valid safetensors file ({exc})") from None
        expected = per_expert.get(name, fused.get(name))
        if expected is None and is_v1_tensor(name):
            raise CloverInputError(path, f"holds tensor '{stored}', a spec v1 block tensor, which is retired; this "
                                         "toolkit reads spec v2 (conv_right_weight, bd_softmax_*: the released format)")
        if expected is None:
            raise CloverInputError(path, f"holds tensor '{stored}', which a Clover model does not have")
        try:
            tensor = handles[path].get_tensor(stored)  # type: ignore[attr-defined]
        except Exception as exc:  # a tensor the index names but the shard does not hold
            raise CloverInputError(path, f"cannot read tensor '{stored}' ({exc})") from None
        if name.endswith(CONV_RIGHT):
            check_conv_right_shape(tuple(tensor.shape), config, stored, path)
            tensor = normalize_conv_right(tensor, config, conv_right_order)
        if tuple(tensor.shape) != expected:
            raise CloverInputError(path, f"tensor '{stored}' has shape {list(tensor.shape)}, but config.json "
                                         f"implies {list(expected)}")
        raw[name] = tensor.to(torch.float32)
    weights_file = model_dir / INDEX_FILE if present(model_dir / INDEX_FILE) else model_dir / SINGLE_FILE
    return _fuse_experts(raw, config, weights_file)


def _fuse_experts(raw: dict[str, torch.Tensor], config: CloverConfig, source: Path) -> dict[str, torch.Tensor]:
    """``source`` is the file named in errors (the index, or the single safetensors file)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(config, fused_experts=True).items():
        if name in raw:
            out[name] = raw.pop(name)
            continue
        prefix, sep, leaf = name.rpartition(".experts.")
        if not sep:
            raise CloverInputError(source, f"tensor '{name}' is missing from the checkpoint")
        parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        per_expert = []
        for e in range(config.num_experts):
            mats = []
            for part in parts:
                key = f"{prefix}.experts.{e}.{part}.weight"
                if key not in raw:
                    raise CloverInputError(source, f"tensor '{key}' is missing from the checkpoint")
                mats.append(raw.pop(key))
            per_expert.append(torch.cat(mats, dim=0))
        out[name] = torch.stack(per_expert)
        assert tuple(out[name].shape) == shape
    if raw:
        raise CloverInputError(source, f"holds tensor '{next(iter(raw))}', which a Clover model does not have")
    return out


def split_experts(state: dict[str, torch.Tensor], config: CloverConfig) -> dict[str, torch.Tensor]:
    """The inverse of fusing: one matrix per expert, as transformers' save_pretrained writes them."""
    out: dict[str, torch.Tensor] = {}
    inter = config.moe_intermediate_size
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj":
            for e in range(config.num_experts):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = tensor[e, :inter]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = tensor[e, inter:]
        elif leaf == "down_proj":
            for e in range(config.num_experts):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def save_state_dict(
    state: dict[str, torch.Tensor],
    model_dir: str | Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    name_prefix: str = "model.",
) -> list[Path]:
    """Write tensors (fused or per-expert) as safetensors, sharded with an index when over max_shard_bytes.

    ``name_prefix`` replaces the leading ``model.`` (use ``model.language_model.`` for the nested layout).
    Files are written under temporary names and renamed only when all are complete.
    """
    model_dir = Path(model_dir)
    torch_dtype = DTYPES[dtype]
    tensors = {}
    for name, tensor in state.items():
        stored = name_prefix + name[len("model."):] if name.startswith("model.") else name
        tensors[stored] = tensor.detach().to(torch_dtype).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written: list[tuple[Path, Path]] = []
    for file_name, shard in zip(names, shards):
        final = model_dir / file_name
        tmp = _temp_path(final)
        save_file(shard, str(tmp), metadata={"format": "pt"})
        written.append((tmp, final))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        final = model_dir / INDEX_FILE
        tmp = _temp_path(final)
        tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        written.append((tmp, final))
    for tmp, final in written:
        os.replace(tmp, final)
    # A stale index would shadow a new single file (and a stale single file confuses readers of shards).
    stale = model_dir / (INDEX_FILE if len(shards) == 1 else SINGLE_FILE)
    if stale.is_file():
        stale.unlink()
    return [final for _, final in written]


def _temp_path(final: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)
