"""CloverConfig: the config.json of a Clover checkpoint (spec section 2).

A Clover config is every field of transformers' ``Qwen3_5MoeTextConfig`` plus the clover fields. The text
fields sit either at the top level or under ``text_config`` (as multimodal Qwen3.5 checkpoints ship them);
the clover fields always sit at the top level.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import block_settings
from .config_numbers import I32_MAX, MAX_LAYERS, first_violation
from .errors import CloverInputError
from .input_files import present, read_json
from .long_numbers import shown


CONFIG_FILE = "config.json"
MODEL_TYPE = "clover_moe"
TEXT_MODEL_TYPE = "qwen3_5_moe_text"
ARCHITECTURES = ["CloverMoeModelLM"]
# spec v1's architecture and config field: retired (spec 2.1), refused with a message that names v2
V1_ARCHITECTURES = ("CloverMoeForBlockDiffusion",)
V1_FIELDS = ("linear_conv_right_kernel_dim",)
DEFAULT_HISTORY_ROWS = 32
LAYER_TYPES = ("linear_attention", "full_attention")

# Fields that belong to the clover extension; everything else is a Qwen3.5-MoE text field.
CLOVER_FIELDS = (
    "block_size",
    "mask_token_id",
    "confidence_threshold",
    "calibrated_block_sizes",
    "calibrated_thresholds",
    "coreset_top_p",
    "history_rows",
    "history_readout_scale",
    "num_shared_experts",
)


def qwen_twin_config(config: dict[str, Any]) -> dict[str, Any]:
    """A Clover config.json without the Clover fields, as a plain Qwen3.5-MoE one: what stock llama.cpp converts
    (the "stock twin" of tests and benches)."""
    twin = {k: v for k, v in config.items() if k not in CLOVER_FIELDS}
    twin.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    return twin


def _refuse_v1(data: Any, path: str | Path | None) -> None:
    """Spec v1 checkpoints are retired (spec 2.1): they never existed outside this project."""
    if not isinstance(data, dict):
        return
    architectures = data.get("architectures") or []
    old = [a for a in architectures if a in V1_ARCHITECTURES] if isinstance(architectures, list) else []
    if old:
        raise CloverInputError(path, f"is {old[0]!r}, a spec v1 Clover checkpoint, which is retired; this toolkit "
                               f"reads spec v2 ({ARCHITECTURES[0]}, the released format)", field="architectures")
    text = data.get("text_config")
    for name in V1_FIELDS:
        if name in data or (isinstance(text, dict) and name in text):
            raise CloverInputError(path, "is a spec v1 field, which is retired; spec v2 takes K_r = "
                                   "linear_conv_kernel_dim - 1 from the conv_right_weight tensors", field=name)


def _default_rope() -> dict[str, Any]:
    return {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class CloverConfig:
    """All hyper-parameters of a Clover model. Defaults are those of Qwen3.5-35B-A3B plus clover defaults."""

    # --- Qwen3.5-MoE text fields ---
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=_default_rope)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # --- clover fields ---
    mask_token_id: int = -1
    block_size: int = 32
    confidence_threshold: float = 0.95
    calibrated_block_sizes: list[int] | None = None
    calibrated_thresholds: list[float] | None = None
    coreset_top_p: float = 1.0
    history_rows: int = DEFAULT_HISTORY_ROWS
    # None: 1/sqrt(linear_key_head_dim), the causal readout's scale (spec 2.2; the release's is not public)
    history_readout_scale: float | None = None
    num_shared_experts: int = 1
    # --- bookkeeping ---
    nested_text_config: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, layers = self.full_attention_interval, self.num_hidden_layers
        if self.layer_types is None and _is_int(n) and n > 0 and _is_int(layers) and layers <= MAX_LAYERS:
            # validate() names a bad interval or layer count
            self.layer_types = [
                "full_attention" if (i + 1) % n == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.calibrated_block_sizes is None:
            self.calibrated_block_sizes = [self.block_size]
        if self.calibrated_thresholds is None:
            self.calibrated_thresholds = [self.confidence_threshold]
        rope = _default_rope()
        rope.update(self.rope_parameters or {})
        self.rope_parameters = rope

    # ----- derived sizes -----
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_right_kernel(self) -> int:
        """K_r, the right-context taps of a GDN layer: linear_conv_kernel_dim - 1 (spec 2.3)."""
        return self.linear_conv_kernel_dim - 1

    @property
    def readout_scale(self) -> float:
        """The history readout's scale (spec 3.2 step 4)."""
        if self.history_readout_scale is None:
            return 1.0 / math.sqrt(self.linear_key_head_dim)
        return float(self.history_readout_scale)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.rope_parameters["partial_rotary_factor"]))

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def is_linear(self, layer: int) -> bool:
        assert self.layer_types is not None
        return self.layer_types[layer] == "linear_attention"

    def threshold_for(self, block_size: int) -> float | None:
        """The calibrated threshold for ``block_size``, or None when that size was not calibrated."""
        assert self.calibrated_block_sizes is not None and self.calibrated_thresholds is not None
        for size, threshold in zip(self.calibrated_block_sizes, self.calibrated_thresholds):
            if size == block_size:
                return float(threshold)
        return None

    # ----- validation -----
    def validate(self, path: str | Path | None = None) -> None:
        """Raise CloverInputError, naming the field, for any value the model cannot run with."""

        def bad(name: str, message: str) -> CloverInputError:
            return CloverInputError(path, message, field=name)

        values = self.numeric_values()
        if (found := first_violation(values)) is not None:
            raise bad(*found)
        if self.linear_conv_kernel_dim < 2:
            raise bad("linear_conv_kernel_dim", f"is {self.linear_conv_kernel_dim}; block mode needs at least 2 "
                      "(K_r = linear_conv_kernel_dim - 1 right taps, spec 2.3)")
        if self.linear_value_head_dim * self.linear_num_value_heads > I32_MAX:
            raise bad("linear_num_value_heads", f"times linear_value_head_dim is "
                      f"{self.linear_value_head_dim * self.linear_num_value_heads}, more than the GGUF's "
                      f"ssm.inner_size may hold ({I32_MAX})")
        if self.hidden_act != "silu":
            raise bad("hidden_act", f"only 'silu' is supported, got {shown(self.hidden_act)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", "must divide num_attention_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_key_heads", "must divide linear_num_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", "must not exceed num_experts")
        if not isinstance(self.layer_types, list):
            raise bad("layer_types", f"must be a list, got {shown(self.layer_types)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise bad("layer_types", f"unknown layer type {shown(kind)}; expected one of {LAYER_TYPES}")
        rope = self.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise bad("rope_parameters.rope_type", f"only 'default' is supported, got {shown(rope['rope_type'])}")
        rotary = self.head_dim * float(rope["partial_rotary_factor"])
        if rotary != int(rotary) or int(rotary) % 2 or int(rotary) > self.head_dim:
            raise bad("rope_parameters.partial_rotary_factor", f"gives a rotary dim of {rotary} for head_dim "
                      f"{self.head_dim}; it must be an even integer no larger than head_dim")
        section = rope["mrope_section"]
        if sum(section) != self.rotary_dim // 2:
            raise bad("rope_parameters.mrope_section", f"sums to {sum(section)}, but must equal rotary_dim/2 = "
                      f"{self.rotary_dim // 2} (llama.cpp aborts otherwise)")
        if self.mask_token_id >= self.vocab_size:
            raise bad("mask_token_id", f"is {self.mask_token_id}; it must be a token id in [0, {self.vocab_size})")
        for eos in self.eos_token_ids:
            if eos >= self.vocab_size:
                raise bad("eos_token_id", f"is {eos}, outside the vocabulary [0, {self.vocab_size})")
        assert self.calibrated_block_sizes is not None and self.calibrated_thresholds is not None
        if len(self.calibrated_block_sizes) != len(self.calibrated_thresholds):
            raise bad("calibrated_thresholds", f"has {len(self.calibrated_thresholds)} entries but "
                      f"calibrated_block_sizes has {len(self.calibrated_block_sizes)}")

    def numeric_values(self) -> dict[str, Any]:
        """The numeric fields of config.json by name (config_numbers.RULES): this config's, with the other
        fields clover-convert writes from config.json when present (kept in ``extra``; a nested text_config's
        over the top level's, as llama.cpp's converter reads them)."""
        values = dict(self.extra)
        text = values.pop("text_config", None)
        if self.nested_text_config and isinstance(text, dict):
            values.update(text)
        values.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                       if f.name not in ("nested_text_config", "extra")})
        return values

    # ----- (de)serialisation -----
    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | Path | None = None) -> "CloverConfig":
        """Build from a config.json dict, top-level or with a nested ``text_config``."""
        if not isinstance(data, dict):
            raise CloverInputError(path, "config must be a JSON object")
        _refuse_v1(data, path)
        known = {f.name for f in dataclasses.fields(cls)} - {"nested_text_config", "extra"}
        nested = isinstance(data.get("text_config"), dict)
        text = dict(data["text_config"]) if nested else dict(data)
        top = data
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in text.items():
            if key in known and key not in CLOVER_FIELDS:
                values[key] = value
            elif not nested:
                if key not in CLOVER_FIELDS:
                    extra[key] = value
        for key in CLOVER_FIELDS:
            if key in top:
                values[key] = top[key]
            elif nested and key in text:
                values[key] = text[key]
        if nested:
            extra = {k: v for k, v in top.items() if k not in CLOVER_FIELDS and k != "text_config"}
            extra["text_config"] = {k: v for k, v in text.items() if k not in known}
        # Older checkpoints keep rope settings at the top level.
        if "rope_parameters" not in values:
            rope: dict[str, Any] = {}
            legacy = text.get("rope_scaling") or {}
            if isinstance(legacy, dict):
                rope.update(legacy)
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in text:
                    rope[key] = text[key]
            if rope:
                values["rope_parameters"] = rope
        if "mask_token_id" not in values:
            raise CloverInputError(path, "is required for a Clover checkpoint", field="mask_token_id")
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if name not in values and name in top:
                values[name] = top[name]
        for name, value in values.items():
            if name == "rope_parameters" and not isinstance(value, dict):
                raise CloverInputError(path, f"must be an object, got {shown(value)}", field=name)
        try:
            config = cls(**values, nested_text_config=nested, extra=extra)
        except (TypeError, ValueError) as exc:
            raise CloverInputError(path, f"invalid value: {exc}") from None
        config.validate(path)
        return config

    def text_fields(self) -> dict[str, Any]:
        """The Qwen3.5-MoE text fields, as ``Qwen3_5MoeTextConfig`` takes them."""
        skip = set(CLOVER_FIELDS) | {"nested_text_config", "extra"}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        out["rope_parameters"] = dict(self.rope_parameters)
        return out

    def clover_fields(self) -> dict[str, Any]:
        """The clover fields; an unset history_readout_scale (the default) is left out."""
        return {name: getattr(self, name) for name in CLOVER_FIELDS
                if not (name == "history_readout_scale" and self.history_readout_scale is None)}

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict; nested if the config was read nested."""
        text = self.text_fields()
        if self.nested_text_config:
            extra = dict(self.extra)
            text_extra = extra.pop("text_config", {})
            out: dict[str, Any] = {"architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE}
            out.update(extra)
            out.update(self.clover_fields())
            out["text_config"] = {"model_type": TEXT_MODEL_TYPE, **text_extra, **text}
            return out
        out = {"architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE}
        out.update(self.extra)
        out.update(text)
        out.update(self.clover_fields())
        return out

    @classmethod
    def load(cls, model_dir: str | Path, overrides: block_settings.Overrides = block_settings.Overrides()
             ) -> "CloverConfig":
        """config.json of ``model_dir``, with the block-diffusion settings found as spec 2.2 says
        (block_settings: other names, generation_config.json, the mask token by name) and ``overrides``."""
        path = Path(model_dir) / CONFIG_FILE
        if not present(path):
            raise CloverInputError(path, "not found; a Clover checkpoint needs a config.json")
        data = read_json(path)
        if not isinstance(data, dict):
            raise CloverInputError(path, "config must be a JSON object")
        return cls.from_dict(block_settings.resolve(Path(model_dir), data, overrides), path)

    def save(self, model_dir: str | Path) -> Path:
        path = Path(model_dir) / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    def replace(self, **changes: Any) -> "CloverConfig":
        return dataclasses.replace(self, **changes)

