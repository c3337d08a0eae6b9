"""general.* metadata for model hubs (ecosystem issue): clover-convert writes general.name, general.size_label
("<total>-A<active>"), general.license and general.base_model.* from the checkpoint's model card and config,
with llama.cpp's key names (gguf's Keys.General); clover-quantize adds general.quantized_by and the right
general.file_type."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, Keys

from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

CARD = """---
license: apache-2.0
base_model: Qwen/Qwen3.5-35B-A3B
tags:
- clover
language:
- en
---
# A tiny Clover
"""


def general(path: Path) -> dict[str, Any]:
    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("general.")}


@pytest.fixture(scope="module")
def carded(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    """The tiny checkpoint with a Hugging Face model card (README.md front matter)."""
    out = module_tmp("card") / "Clover-Tiny"
    shutil.copytree(tiny_checkpoint, out)
    (out / "README.md").write_text(CARD, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def carded_f16(carded: Path) -> Path:
    return clover_convert(carded, carded.parent / "clover-tiny-f16.gguf", "f16")


def test_size_label_total_and_active() -> None:
    from clover_convert.converter import moe_size_label

    # Clover-35B-A3B's real dims: 256 experts, 8 used (the numbers clover-convert --dry-run counts on 35b-shape)
    assert moe_size_label(34_660_610_688, 1_871_016_576, 128_090_112, 256, 8) == "35B-A3B"
    assert moe_size_label(7_615_616_512, 7_615_616_512, 0, 0, 0) == "7.6B"  # dense: gguf's own label


def test_35b_shape_dry_run_label(tmp_path: Path) -> None:
    """The full-size config (no weights, a dry run) gets "35B-A3B" from its tensor shapes, not from a name."""
    from clover_convert.converter import ConvertOptions, convert
    from clover_ref.factory import init_checkpoint

    model = tmp_path / "model"
    init_checkpoint(model, "35b-shape", config_only=True)
    result = convert(ConvertOptions(model, outfile=tmp_path / "out.gguf", dry_run=True))
    assert result.metadata is not None and result.metadata.size_label == "35B-A3B"


def test_convert_writes_hub_metadata(carded: Path, carded_f16: Path) -> None:
    g = general(carded_f16)
    k = Keys.General
    assert g[k.ARCHITECTURE] == "clover_moe"
    assert g[k.NAME] == "Clover Tiny"
    assert g[k.SIZE_LABEL].count("-A") == 1, g[k.SIZE_LABEL]  # "<total>-A<active>"
    assert g[k.LICENSE] == "apache-2.0"
    assert g[k.BASE_MODEL_COUNT] == 1
    assert g[k.BASE_MODEL_NAME.format(id=0)] == "Qwen3.5 35B A3B"
    assert g[k.BASE_MODEL_ORGANIZATION.format(id=0)] == "Qwen"
    assert g[k.BASE_MODEL_REPO_URL.format(id=0)] == "https://huggingface.co/Qwen/Qwen3.5-35B-A3B"
    assert g[k.TAGS] == ["clover"] and g[k.LANGUAGES] == ["en"]
    assert g[k.FILE_TYPE] == 1  # LLAMA_FTYPE_MOSTLY_F16
    assert k.QUANTIZED_BY not in g  # a conversion is not a quantization
    # the size label from the tensors: total = shared + 8 experts x per-expert, active = shared + 2 experts
    from clover_convert.converter import moe_size_label

    reader = GGUFReader(carded_f16)
    total = shared = per_expert = 0
    n_expert = 0
    for t in reader.tensors:
        n = int(t.n_elements)
        total += n
        if "_exps." in t.name:
            n_expert = int(t.shape[-1])
            per_expert += n // n_expert
        else:
            shared += n
    assert g[k.SIZE_LABEL] == moe_size_label(total, shared, per_expert, n_expert, 2)


def test_metadata_file_overrides(carded: Path, tmp_path: Path) -> None:
    import json
    import subprocess

    from clover_dev import VENV_PYTHON

    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"general.name": "Clover Tiny Test", "general.license": "mit",
                                "general.size_label": "1M-A1M"}))
    out = tmp_path / "o.gguf"
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(carded), "--outfile", str(out),
                           "--outtype", "f32", "--metadata", str(meta)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    g = general(out)
    assert (g["general.name"], g["general.license"], g["general.size_label"]) == ("Clover Tiny Test", "mit", "1M-A1M")


@pytest.mark.parametrize("qtype,ftype", [("Q8_0", 7), ("Q4_K_M", 15)])
@pytest.mark.native
def test_quantize_records_quantized_by(carded_f16: Path, qtype: str, ftype: int) -> None:
    from clover_quantize.run import QuantizeOptions, quantize
    from clover_quantize.file_types import file_type

    out = carded_f16.with_name(f"clover-tiny-{qtype}.gguf")
    quantize(QuantizeOptions(input=carded_f16, file_type=file_type(qtype), output=out, progress=False))
    g = general(out)
    assert g[Keys.General.QUANTIZED_BY] == "clover-quantize"
    assert g[Keys.General.FILE_TYPE] == ftype == file_type(qtype).ftype
    src = general(carded_f16)
    for key in (Keys.General.NAME, Keys.General.SIZE_LABEL, Keys.General.LICENSE, Keys.General.BASE_MODEL_COUNT):
        assert g[key] == src[key], key  # the conversion's metadata survives
