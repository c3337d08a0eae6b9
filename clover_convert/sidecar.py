"""The block-diffusion sidecar (spec v2 section 5, "Files").

A sidecar is a small GGUF of a Clover architecture holding only the block-diffusion keys and tensors, plus
``ARCH.bd.trunk_fingerprint``: a string that a trunk file (ours, or one written by llama.cpp's converter) gives
the same way. The patched loader attaches a sidecar to any trunk with an equal fingerprint and names the differing
fields otherwise (libclover computes the trunk's side from its GGUF header). A fingerprint proves compatibility, not
identity: two trunks of one shape and vocabulary with different weights share it.

    L=<layers>;gdn=<GDN layer indices, comma-separated>;nk=;nv=;dk=;dv=;kc=<conv kernel>;vocab=<n>;tok=<sha256>

``tok`` is the SHA-256 of ``tokenizer.ggml.tokens`` encoded as UTF-8 and joined with NUL bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clover_common.config import CloverConfig

FINGERPRINT_KEY = "bd.trunk_fingerprint"  # under the architecture's prefix
SIDECAR_TYPE = "bd_sidecar"  # general.type of a sidecar
SIDECAR_SUFFIX = ".bd.gguf"
# the GGUF names of a GDN layer's block-diffusion tensors (spec 5), after "blk.N."
BD_TENSOR_SUFFIXES = ("bd_conv_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")
FINGERPRINT_FIELDS = ("L", "gdn", "nk", "nv", "dk", "dv", "kc", "vocab", "tok")


def is_bd_tensor(gguf_name: str) -> bool:
    """Whether a GGUF tensor name is one of the block-diffusion tensors ("blk.N.bd_...")."""
    return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[-1] in BD_TENSOR_SUFFIXES


def sidecar_path(trunk: Path) -> Path:
    """``NAME.bd.gguf`` beside the trunk ``NAME.gguf`` (the first shard's name without its shard suffix)."""
    stem = trunk.name.removesuffix(".gguf")
    return trunk.with_name(stem + SIDECAR_SUFFIX)


def tokens_digest(tokens: Sequence[str]) -> str:
    return hashlib.sha256(b"\0".join(t.encode("utf-8") for t in tokens)).hexdigest()


def fingerprint(n_layer: int, gdn_layers: Sequence[int], n_k: int, n_v: int, d_k: int, d_v: int, kernel: int,
                tokens: Sequence[str]) -> str:
    fields = (n_layer, ",".join(str(i) for i in gdn_layers), n_k, n_v, d_k, d_v, kernel, len(tokens),
              tokens_digest(tokens))
    return ";".join(f"{name}={value}" for name, value in zip(FINGERPRINT_FIELDS, fields))


def config_fingerprint(config: CloverConfig, tokens: Sequence[str]) -> str:
    """The fingerprint of the trunk that ``config`` and the token list (as the GGUF stores it) convert to."""
    c = config
    return fingerprint(c.num_hidden_layers, [i for i in range(c.num_hidden_layers) if c.is_linear(i)],
                       c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                       c.linear_value_head_dim, c.linear_conv_kernel_dim, tokens)


def gguf_fingerprint(path: Path) -> str:
    """The fingerprint of a trunk GGUF, from its header: llama.cpp's qwen35moe rules (the recurrent layers from
    ``attention.recurrent_layers``, else every layer but each ``full_attention_interval``-th)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"{arch}.{key}")
        return field.contents() if field is not None else default

    n_layer = int(value("block_count"))
    recurrent = value("attention.recurrent_layers")
    if recurrent is None:
        interval = int(value("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    n_v, d_inner = int(value("ssm.time_step_rank")), int(value("ssm.inner_size"))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return fingerprint(n_layer, [i for i in range(n_layer) if recurrent[i]], int(value("ssm.group_count")), n_v,
                       int(value("ssm.state_size")), d_inner // n_v, int(value("ssm.conv_kernel")), tokens)


def differing_fields(a: str, b: str) -> list[str]:
    """The names of the fields in which two fingerprints differ (all of them for a malformed one)."""
    def parse(text: str) -> dict[str, str]:
        return dict(part.partition("=")[::2] for part in text.split(";"))

    pa, pb = parse(a), parse(b)
    return [name for name in FINGERPRINT_FIELDS if pa.get(name) != pb.get(name)]
