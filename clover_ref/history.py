"""The committed history of a sequence: what causal passes write and block passes only read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionCache:
    """Keys (after q/k norm and rotary) and values of the committed positions: [n_kv_heads, T, head_dim]."""

    keys: torch.Tensor
    values: torch.Tensor

    def clone(self) -> "AttentionCache":
        return AttentionCache(self.keys.clone(), self.values.clone())


@dataclass
class DeltaNetState:
    """A GDN layer's state after the last committed position.

    ``conv``: the last K-1 pre-convolution inputs (``in_proj_qkv`` outputs), [conv_dim, K-1], oldest first.
    ``ssm``: the delta-rule state S, [n_v_heads, head_k_dim, head_v_dim] in Hugging Face value-head order;
    the readout of a query q is S^T q, as causal mode computes it.
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    def clone(self) -> "DeltaNetState":
        return DeltaNetState(self.conv.clone(), self.ssm.clone())


@dataclass
class History:
    """Committed positions [0, length) of one sequence, per layer."""

    length: int = 0
    layers: list[AttentionCache | DeltaNetState] = field(default_factory=list)

    def clone(self) -> "History":
        return History(self.length, [layer.clone() for layer in self.layers])

    def equals(self, other: "History") -> bool:
        """Bitwise equality of every cached tensor."""
        if self.length != other.length or len(self.layers) != len(other.layers):
            return False
        for mine, theirs in zip(self.layers, other.layers):
            if type(mine) is not type(theirs):
                return False
            if isinstance(mine, AttentionCache):
                assert isinstance(theirs, AttentionCache)
                pairs = [(mine.keys, theirs.keys), (mine.values, theirs.values)]
            else:
                assert isinstance(theirs, DeltaNetState)
                pairs = [(mine.conv, theirs.conv), (mine.ssm, theirs.ssm)]
            if not all(torch.equal(a, b) for a, b in pairs):
                return False
        return True
