"""Where the weights go: llama.cpp's offload options for the engine (docs/native.md, "A 35B on one 24 GB GPU").

``Offload`` carries ``-ot/--override-tensor``, ``--cpu-moe``, ``--n-cpu-moe``, ``-sm/--split-mode``,
``-mg/--main-gpu``, ``-ts/--tensor-split``, ``--fit-target`` and ``--rpc`` with llama.cpp's names, syntax and
meanings; ``apply`` writes them into ``clover_engine_params``, and libclover resolves them into
``llama_model_params`` (``clover_engine_describe_offload`` shows the result). Bad values are refused by libclover
at load with a message naming the option. ``--rpc`` registers remote devices (rpc-server) with ggml's backend
registry before the load (``clover_rpc_add_servers``), so ``-ngl`` layers go to them (docs/distributed.md).

``device_bytes`` is the planner of ``bench/plan_35b.py``: which device llama.cpp puts each weight on, from the
tensor list and the options (llama_model_base::load_tensors: the input layer on the CPU, the last
``n_gpu_layers`` of the ``n_layer + 1`` layers (output included) on the GPU, then the first override whose regex
matches the name). It needs no GPU, so the plan of a 24 GB card can be made here.
"""

from __future__ import annotations

import argparse
import ctypes
import re
from dataclasses import dataclass
from typing import Iterable

from clover_common.errors import BadInput

# llama.cpp's common/common.h (the test checks libclover's --n-cpu-moe patterns against these)
LLM_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode (tensor is refused for clover by llama.cpp)
DEFAULT_FIT_TARGET_MIB = 1024  # llama.cpp's --fit-target default


def ffn_exps_block_regex(layer: int) -> str:
    """llama.cpp's llm_ffn_block_regex(layer, LLM_FFN_EXPS_REGEX): one --n-cpu-moe pattern."""
    return rf"blk\.{layer}{LLM_FFN_EXPS_REGEX}"


@dataclass
class Offload:
    override_tensor: str | None = None  # "regex=BUFT,regex2=BUFT2"
    n_cpu_moe: int = 0
    cpu_moe: bool = False
    split_mode: str | None = None  # none | layer | row; None = llama.cpp's default (layer)
    main_gpu: int = 0
    tensor_split: str | None = None  # "3,1"
    fit_target_mib: int = DEFAULT_FIT_TARGET_MIB  # < 0: no fit check at load
    rpc: str | None = None  # "host:port,host:port": rpc-server endpoints, registered for the process

    def apply(self, params: ctypes.Structure) -> list[bytes]:
        """Write into a clover_engine_params; returns the encoded strings, which the caller keeps alive until the
        load returns (ctypes also keeps a reference in the struct)."""
        keep: list[bytes] = []
        if self.rpc:
            add_rpc_servers(self.rpc)

        def text(value: str | None) -> bytes | None:
            if not value:
                return None
            keep.append(value.encode())
            return keep[-1]

        params.override_tensor = text(self.override_tensor)
        params.n_cpu_moe = int(self.n_cpu_moe)
        params.cpu_moe = bool(self.cpu_moe)
        if self.split_mode is None:
            params.split_mode = -1
        elif self.split_mode in SPLIT_MODES:
            params.split_mode = SPLIT_MODES[self.split_mode]
        else:
            raise BadInput(f"-sm/--split-mode must be one of {', '.join(SPLIT_MODES)}, got {self.split_mode!r}")
        params.main_gpu = int(self.main_gpu)
        params.tensor_split = text(self.tensor_split)
        params.fit_margin_mib = int(self.fit_target_mib)
        return keep

    def overrides(self, n_layer: int) -> list[tuple[str, str]]:
        """(regex, buffer type) in the order libclover passes them to llama.cpp (-ot, --cpu-moe, --n-cpu-moe)."""
        out: list[tuple[str, str]] = []
        for item in (self.override_tensor or "").split(","):
            if item:
                pattern, _, buft = item.partition("=")
                out.append((pattern, buft))
        if self.cpu_moe:
            out.append((LLM_FFN_EXPS_REGEX, "CPU"))
        out += [(ffn_exps_block_regex(i), "CPU") for i in range(min(self.n_cpu_moe, n_layer))]
        return out


def add_rpc_servers(servers: str) -> int:
    """llama.cpp's --rpc: register the rpc-server endpoints ("host:port,...") as devices of this process (each
    endpoint once); the number of devices added. ValueError with libclover's message when an endpoint is malformed,
    unreachable, or the build has no RPC backend."""
    from clover_native import libclover

    err = ctypes.create_string_buffer(1024)
    n = libclover.lib().clover_rpc_add_servers(servers.encode(), err, len(err))
    if n < 0:
        raise BadInput(err.value.decode("utf-8", "replace"))
    return int(n)


def add_offload_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's flags, names and meanings (common/arg.cpp)."""
    p.add_argument("-ot", "--override-tensor", action="append", default=None, metavar="REGEX=BUFT[,...]",
                   help="buffer type for tensors whose name matches REGEX (llama.cpp's syntax; e.g. exps=CPU); "
                   "repeatable")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep all MoE expert weights in host memory")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N",
                   help="keep the MoE expert weights of the first N layers in host memory")
    p.add_argument("-sm", "--split-mode", choices=list(SPLIT_MODES), default=None,
                   help="how to split the model across GPUs: none, layer (default), row")
    p.add_argument("-ts", "--tensor-split", default=None, metavar="N0,N1,...",
                   help="proportion of the model on each GPU, e.g. 3,1")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="INDEX",
                   help="the GPU for the model (split-mode none) or for intermediate results and KV (row)")
    p.add_argument("-fitt", "--fit-target", type=int, default=DEFAULT_FIT_TARGET_MIB, metavar="MiB",
                   help="memory each GPU must keep free; a load whose plan leaves less is refused (-1: no check)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="offload to rpc-server backends (llama.cpp's --rpc; with -ngl); rpc-server has no "
                   "authentication: keep it on localhost or a trusted network (docs/distributed.md)")


def offload_from_args(args: argparse.Namespace) -> Offload:
    """The Offload of parsed CLI args; a value no model could accept is a ValueError naming the flag."""
    if args.n_cpu_moe < 0:
        raise BadInput(f"-ncmoe/--n-cpu-moe must be >= 0, got {args.n_cpu_moe}")
    if args.main_gpu < 0:
        raise BadInput(f"-mg/--main-gpu must be >= 0, got {args.main_gpu}")
    return Offload(override_tensor=",".join(args.override_tensor) if args.override_tensor else None,
                   n_cpu_moe=args.n_cpu_moe, cpu_moe=args.cpu_moe, split_mode=args.split_mode,
                   main_gpu=args.main_gpu, tensor_split=args.tensor_split, fit_target_mib=args.fit_target,
                   rpc=getattr(args, "rpc", None))


_LAYER = re.compile(r"^blk\.(\d+)\.")


def device_bytes(tensors: Iterable[tuple[str, int]], n_layer: int, n_gpu_layers: int,
                 overrides: list[tuple[str, str]], gpu: str = "GPU") -> dict[str, int]:
    """Bytes of weights per buffer type on a one-GPU machine, as llama.cpp assigns them ({"CPU": .., gpu: ..}).

    tensors: (name, bytes). Layer il (0..n_layer-1) and the output layer (il = n_layer) go to the GPU when
    il >= n_layer + 1 - n_gpu_layers (n_gpu_layers < 0: all); token_embd (the input layer) stays on the CPU;
    the first override whose regex is found in the name decides instead (std::regex_search, in order).
    """
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    start = max(n_layer + 1 - ngl, 0)
    compiled = [(re.compile(p), b) for p, b in overrides]
    out = {"CPU": 0, gpu: 0}
    for name, nbytes in tensors:
        m = _LAYER.match(name)
        if name.startswith("token_embd"):
            dev = "CPU"
        else:
            il = int(m.group(1)) if m else n_layer  # output, output_norm: the output layer
            dev = gpu if ngl > 0 and il >= start else "CPU"
        for rx, buft in compiled:
            if rx.search(name):
                dev = "CPU" if buft.upper().startswith("CPU") else gpu
                break
        out[dev] = out.get(dev, 0) + nbytes
    return out
