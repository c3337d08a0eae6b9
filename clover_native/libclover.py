"""ctypes binding of the Clover decoding engine's C API (cpp_patch/tools/clover/clover.h).

The structs and prototypes below mirror clover.h field by field. ``lib()`` loads ``libclover.so`` from the
folder that holds ``libllama.so`` (``clover_native.loader.lib_dir()``), after ``clover_native.loader`` has loaded
libllama through llama-cpp-python (RTLD_GLOBAL), so the engine and the Python tokenizer calls share one
libllama.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from . import loader
from .loader import NativeError

CLOVER_MAX_CALIBRATED = 16
CLOVER_HIST_SIZE = 65

# enum clover_mode
CLOVER_MODE_AR = 0
CLOVER_MODE_DIFFUSION = 1
CLOVER_MODE_SPEC = 2
CLOVER_MODE_AUTO = 3
MODES = {"ar": CLOVER_MODE_AR, "diffusion": CLOVER_MODE_DIFFUSION, "spec": CLOVER_MODE_SPEC, "auto": CLOVER_MODE_AUTO}
MODE_NAMES = {v: k for k, v in MODES.items()}

# enum clover_draft_kind (clover_stats.auto_rounds)
DRAFT_KINDS = ("none", "ngram", "block")

# enum clover_stop_reason
CLOVER_STOP_NONE = 0
CLOVER_STOP_LENGTH = 1
CLOVER_STOP_EOG = 2
CLOVER_STOP_CONTEXT = 3
CLOVER_STOP_CANCELLED = 4
# the names the PyTorch reference uses for its stop reasons (GenerationStats.stop_reason)
STOP_REASONS = {CLOVER_STOP_NONE: "", CLOVER_STOP_LENGTH: "length", CLOVER_STOP_EOG: "eos",
                CLOVER_STOP_CONTEXT: "context", CLOVER_STOP_CANCELLED: "cancelled"}

llama_token = ctypes.c_int32
llama_token_p = ctypes.POINTER(llama_token)


class clover_model_info(ctypes.Structure):
    _fields_ = [
        ("block_size", ctypes.c_int32),
        ("threshold", ctypes.c_float),
        ("mask_token_id", ctypes.c_int32),
        ("conv_right_kernel", ctypes.c_int32),
        ("n_calibrated", ctypes.c_int32),
        ("calibrated_block_sizes", ctypes.c_int32 * CLOVER_MAX_CALIBRATED),
        ("calibrated_thresholds", ctypes.c_float * CLOVER_MAX_CALIBRATED),
        ("n_vocab", ctypes.c_int32),
        ("n_ctx_train", ctypes.c_int32),
        ("coreset_top_p", ctypes.c_float),
        ("history_rows", ctypes.c_int32),
        ("has_block_diffusion", ctypes.c_int32),
        # the default penalties (spec 4): general.sampling.penalty_repeat, _penalty_present, _penalty_freq
        ("repeat_penalty", ctypes.c_float),
        ("presence_penalty", ctypes.c_float),
        ("frequency_penalty", ctypes.c_float),
    ]


class clover_engine_params(ctypes.Structure):
    _fields_ = [
        ("n_ctx", ctypes.c_int32),
        ("n_batch", ctypes.c_int32),
        ("max_block_size", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("n_gpu_layers", ctypes.c_int32),
        ("use_extra_bufts", ctypes.c_bool),
        # where the weights go (clover_cpp/offload.py)
        ("override_tensor", ctypes.c_char_p),
        ("n_cpu_moe", ctypes.c_int32),
        ("cpu_moe", ctypes.c_bool),
        ("split_mode", ctypes.c_int32),
        ("main_gpu", ctypes.c_int32),
        ("tensor_split", ctypes.c_char_p),
        ("fit_margin_mib", ctypes.c_int32),
        ("n_parallel", ctypes.c_int32),
        ("bd_path", ctypes.c_char_p),  # a block-diffusion sidecar (spec 5), or NULL
        ("n_prefill_chunk", ctypes.c_int32),  # with slots: prompt tokens per prefill pass; 0 = n_batch
        ("n_graph_cache", ctypes.c_int32),  # graphs kept besides the last one; -1 = the default
    ]


class clover_device_memory(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 64),
        ("is_host", ctypes.c_bool),
        ("free", ctypes.c_int64),
        ("total", ctypes.c_int64),
        ("model", ctypes.c_int64),
        ("context", ctypes.c_int64),
        ("compute", ctypes.c_int64),
    ]


# typedef bool (*clover_logprobs_cb)(llama_token token, float logprob, const llama_token * top_ids,
#                                    const float * top_logprobs, int32_t n_top, void * user_data);
clover_logprobs_cb = ctypes.CFUNCTYPE(ctypes.c_bool, llama_token, ctypes.c_float, llama_token_p,
                                      ctypes.POINTER(ctypes.c_float), ctypes.c_int32, ctypes.c_void_p)


class clover_gen_params(ctypes.Structure):
    _fields_ = [
        ("mode", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("threshold", ctypes.c_float),
        ("draft_steps", ctypes.c_int32),
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_float),
        ("seed", ctypes.c_uint32),
        ("max_tokens", ctypes.c_int32),
        ("stop_ids", llama_token_p),
        ("n_stop_ids", ctypes.c_int32),
        ("banned_ids", llama_token_p),
        ("n_banned_ids", ctypes.c_int32),
        ("coreset_top_p", ctypes.c_float),  # <= 0: the GGUF's value
        # the distribution stage (spec 4): logit_bias, penalties (NaN: the GGUF's), grammar, logprobs
        ("bias_ids", llama_token_p),
        ("bias_values", ctypes.POINTER(ctypes.c_float)),
        ("n_bias", ctypes.c_int32),
        ("repeat_penalty", ctypes.c_float),
        ("presence_penalty", ctypes.c_float),
        ("frequency_penalty", ctypes.c_float),
        ("grammar", ctypes.c_char_p),
        ("grammar_root", ctypes.c_char_p),
        ("grammar_after_ids", llama_token_p),
        ("n_grammar_after_ids", ctypes.c_int32),
        ("n_logprobs", ctypes.c_int32),
        ("on_logprobs", clover_logprobs_cb),
        ("spec_fused", ctypes.c_int32),  # spec: 1 = fused verify + draft passes where possible, 0 = off
    ]


class clover_pass_costs(ctypes.Structure):
    _fields_ = [
        ("ar_ms", ctypes.c_float),
        ("causal_fixed_ms", ctypes.c_float),
        ("causal_row_ms", ctypes.c_float),
        ("rebuild_ms", ctypes.c_float),
        ("block_fixed_ms", ctypes.c_float),
        ("block_row_ms", ctypes.c_float),
    ]


class clover_stats(ctypes.Structure):
    _fields_ = [
        ("n_prompt_tokens", ctypes.c_int32),
        ("n_generated", ctypes.c_int32),
        ("n_block_passes", ctypes.c_int32),
        ("n_causal_passes", ctypes.c_int32),
        ("t_prefill_ms", ctypes.c_double),
        ("t_block_ms", ctypes.c_double),
        ("t_causal_ms", ctypes.c_double),
        ("steps_per_block", ctypes.c_int32 * CLOVER_HIST_SIZE),
        ("accepted_lengths", ctypes.c_int32 * CLOVER_HIST_SIZE),
        ("stop_reason", ctypes.c_int32),
        ("auto_rounds", ctypes.c_int32 * len(DRAFT_KINDS)),
        ("auto_drafted", ctypes.c_int32),
        ("auto_accepted", ctypes.c_int32),
        ("auto_accepted_block", ctypes.c_int32),
        ("n_graph_reuses", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        # the resolved settings: no "the GGUF's value" left
        ("block_size", ctypes.c_int32),
        ("threshold", ctypes.c_float),
        ("coreset_top_p", ctypes.c_float),
        ("n_fused_passes", ctypes.c_int32),
        ("n_replays", ctypes.c_int32),
    ]


class clover_cache_info(ctypes.Structure):
    _fields_ = [
        ("n_checkpoints", ctypes.c_int32),
        ("n_bytes", ctypes.c_int64),
        ("max_bytes", ctypes.c_int64),
        ("checkpoint_bytes", ctypes.c_int64),
        ("n_saved", ctypes.c_int64),
        ("n_evicted", ctypes.c_int64),
        ("n_restored", ctypes.c_int64),
        ("n_reused_tokens", ctypes.c_int64),
    ]


clover_engine_p = ctypes.c_void_p
clover_slot_p = ctypes.c_void_p

# typedef bool (*clover_tokens_cb)(const llama_token * tokens, int32_t n_tokens, void * user_data);
clover_tokens_cb = ctypes.CFUNCTYPE(ctypes.c_bool, llama_token_p, ctypes.c_int32, ctypes.c_void_p)
# typedef bool (*clover_step_cb)(const llama_token * canvas, int32_t n_canvas, void * user_data);
clover_step_cb = ctypes.CFUNCTYPE(ctypes.c_bool, llama_token_p, ctypes.c_int32, ctypes.c_void_p)

_PROTOTYPES: dict[str, tuple[object, list[object]]] = {
    "clover_engine_default_params": (clover_engine_params, []),
    "clover_gen_default_params": (clover_gen_params, []),
    "clover_model_info_threshold": (ctypes.c_float, [ctypes.POINTER(clover_model_info), ctypes.c_int32]),
    "clover_model_info_read": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(clover_model_info),
                                                ctypes.c_char_p, ctypes.c_size_t]),
    "clover_engine_load": (clover_engine_p, [ctypes.c_char_p, clover_engine_params, ctypes.c_char_p,
                                             ctypes.c_size_t]),
    "clover_engine_free": (None, [clover_engine_p]),
    "clover_engine_describe_offload": (ctypes.c_int32, [ctypes.c_char_p, clover_engine_params, ctypes.c_char_p,
                                                        ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]),
    "clover_engine_plan_memory": (ctypes.c_int32, [ctypes.c_char_p, clover_engine_params,
                                                   ctypes.POINTER(clover_device_memory), ctypes.c_int32,
                                                   ctypes.c_char_p, ctypes.c_size_t]),
    "clover_check_fit": (ctypes.c_int32, [ctypes.POINTER(clover_device_memory), ctypes.c_int32, ctypes.c_int32,
                                          ctypes.c_char_p, ctypes.c_size_t]),
    "clover_rpc_add_servers": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "clover_engine_info": (ctypes.POINTER(clover_model_info), [clover_engine_p]),
    "clover_engine_model": (ctypes.c_void_p, [clover_engine_p]),
    "clover_engine_context": (ctypes.c_void_p, [clover_engine_p]),
    "clover_slot_reset": (None, [clover_slot_p]),
    "clover_engine_slot": (clover_slot_p, [clover_engine_p, ctypes.c_int32]),
    "clover_engine_n_parallel": (ctypes.c_int32, [clover_engine_p]),
    "clover_engine_pass_stats": (None, [clover_engine_p, ctypes.POINTER(ctypes.c_int64),
                                        ctypes.POINTER(ctypes.c_int64)]),
    "clover_engine_block_pass_stats": (None, [clover_engine_p, ctypes.POINTER(ctypes.c_int64),
                                              ctypes.POINTER(ctypes.c_int64)]),
    "clover_slot_n_past": (ctypes.c_int32, [clover_slot_p]),
    "clover_engine_n_ctx": (ctypes.c_int32, [clover_engine_p]),
    "clover_engine_max_block_size": (ctypes.c_int32, [clover_engine_p]),
    "clover_engine_n_threads": (ctypes.c_int32, [clover_engine_p]),
    "clover_default_n_threads": (ctypes.c_int32, []),
    "clover_engine_check_grammar": (ctypes.c_int32, [clover_engine_p, ctypes.c_char_p, ctypes.c_char_p,
                                                     ctypes.c_char_p, ctypes.c_size_t]),
    "clover_json_schema_to_grammar": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                       ctypes.c_char_p, ctypes.c_size_t]),
    "clover_slot_generate": (ctypes.c_int32, [clover_slot_p, llama_token_p, ctypes.c_int32,
                                              ctypes.POINTER(clover_gen_params), clover_tokens_cb, clover_step_cb,
                                              ctypes.c_void_p, ctypes.POINTER(clover_stats)]),
    "clover_slot_last_error": (ctypes.c_char_p, [clover_slot_p]),
    "clover_block_decode": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p]),
    "clover_slot_set_cache": (None, [clover_slot_p, ctypes.c_int64, ctypes.c_int32]),
    "clover_slot_reuse_prefix": (ctypes.c_int32, [clover_slot_p, llama_token_p, ctypes.c_int32]),
    "clover_slot_cache_info": (None, [clover_slot_p, ctypes.POINTER(clover_cache_info)]),
    "clover_slot_checkpoint_hint": (None, [clover_slot_p, ctypes.c_int32]),
    "clover_slot_set_history": (ctypes.c_int32, [clover_slot_p, llama_token_p, ctypes.c_int32]),
    "clover_slot_measure_costs": (ctypes.c_int32, [clover_slot_p, ctypes.POINTER(clover_pass_costs)]),
    # returned strings are malloc'd by libclover: c_void_p, so that ctypes hands back the pointer to free
    "clover_chat_templates_init": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                                     ctypes.c_size_t]),
    "clover_chat_templates_free": (None, [ctypes.c_void_p]),
    "clover_chat_templates_apply": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                                      ctypes.c_size_t]),
    "clover_chat_parse": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_bool, ctypes.c_char_p,
                                            ctypes.c_size_t]),
    "clover_chat_string_free": (None, [ctypes.c_void_p]),
}

_lib: ctypes.CDLL | None = None


def lib_path() -> Path:
    d = loader.lib_dir()
    return d / ("libclover.dylib" if sys.platform == "darwin" else "libclover.so")


def available() -> tuple[bool, str]:
    """(True, "") when libclover can be loaded, else (False, reason)."""
    ok, reason = loader.native_available()
    if not ok:
        return ok, reason
    return loader.loadable(lib_path(), lib, f"{lib_path()} not found (the engine is built by `make native`)")


def lib() -> ctypes.CDLL:
    """libclover with every prototype of clover.h declared (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    loader.llama()  # libllama (and ggml) first, through llama-cpp-python, bound to the same folder
    path = lib_path()
    if not path.exists():
        raise NativeError(f"{path} not found: build the engine with `make native`")
    # make libllama's symbols global so libclover resolves against the very copy llama_cpp loaded
    llama_so = loader.lib_dir() / path.name.replace("clover", "llama")
    if llama_so.exists():
        ctypes.CDLL(str(llama_so), mode=ctypes.RTLD_GLOBAL)
    try:
        handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise NativeError(f"cannot load {path}: {exc}") from exc
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(handle, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    if missing:
        raise NativeError(f"{path} lacks {', '.join(missing)} (stale build?)")
    _lib = handle
    return handle


def read_model_info(path: str, bd_path: str | None = None) -> clover_model_info:
    """The clover settings of a GGUF file (and of its block-diffusion sidecar), read without loading the weights."""
    info = clover_model_info()
    err = ctypes.create_string_buffer(2048)
    L = lib()
    with loader.logged_errors() as logged:  # gguf's reason for a damaged file is only logged
        rc = L.clover_model_info_read(str(path).encode(), str(bd_path).encode() if bd_path else None,
                                      ctypes.byref(info), err, len(err))
    if rc != 0:
        msg = err.value.decode("utf-8", "replace") or "cannot read the clover settings"
        reasons = loader.error_reasons(logged)
        where = "" if str(path) in msg else f"{path}: "  # libclover's messages name the file themselves
        raise NativeError(f"{where}{msg}" + (f": {reasons}" if reasons else ""))
    return info


def token_array(ids: list[int] | None) -> tuple[ctypes.Array | None, int]:
    if ids is None:
        return None, 0
    arr = (llama_token * max(1, len(ids)))(*[int(t) for t in ids])
    return arr, len(ids)


def json_schema_to_grammar(schema_json: str) -> str:
    """GBNF for a JSON schema, converted as llama-server does (common/json-schema-to-grammar). Raises NativeError
    with the converter's message for text that is not JSON or a schema it cannot express."""
    L = lib()
    err = ctypes.create_string_buffer(2048)
    out = ctypes.create_string_buffer(1 << 16)  # most grammars fit: one conversion (its warnings printed once)
    n = int(L.clover_json_schema_to_grammar(schema_json.encode(), out, len(out), err, len(err)))
    if n < 0:
        raise NativeError(err.value.decode(errors="replace"))
    if n >= len(out):  # it did not fit: the length is known now
        out = ctypes.create_string_buffer(n + 1)
        L.clover_json_schema_to_grammar(schema_json.encode(), out, len(out), err, len(err))
    return out.value.decode()


def take_string(ptr: int | None) -> str | None:
    """A string libclover returned (malloc'd), decoded and freed; None for NULL."""
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        lib().clover_chat_string_free(ptr)


def describe_offload(path: str, params: clover_engine_params) -> dict[str, object]:
    """The llama_model_params libclover would load with: n_gpu_layers, split_mode, main_gpu, tensor_split (floats)
    and overrides [(regex, buffer type)], in llama.cpp's order. Raises NativeError with the load's message."""
    out = ctypes.create_string_buffer(1 << 16)
    err = ctypes.create_string_buffer(2048)
    if lib().clover_engine_describe_offload(str(path).encode(), params, out, len(out), err, len(err)) != 0:
        raise NativeError(f"{path}: {err.value.decode('utf-8', 'replace')}")
    desc: dict[str, object] = {"overrides": []}
    for line in out.value.decode().splitlines():
        key, _, value = line.partition("=")
        if key == "override":
            pattern, _, buft = value.rpartition("=")
            desc["overrides"].append((pattern, buft))  # type: ignore[union-attr]
        elif key == "tensor_split":
            desc[key] = [float(v) for v in value.split(",")] if value else []
        else:
            desc[key] = int(value)
    return desc


def plan_memory(path: str, params: clover_engine_params) -> list[dict[str, object]]:
    """Per device (host last), what a load with these params allocates: llama.cpp's no_alloc dry run."""
    arr = (clover_device_memory * 32)()
    err = ctypes.create_string_buffer(2048)
    n = lib().clover_engine_plan_memory(str(path).encode(), params, arr, len(arr), err, len(err))
    if n < 0:
        raise NativeError(f"{path}: {err.value.decode('utf-8', 'replace')}")
    return [{"name": d.name.decode(), "is_host": d.is_host, "free": d.free, "total": d.total, "model": d.model,
             "context": d.context, "compute": d.compute} for d in arr[:n]]


def check_fit(devices: list[dict[str, object]], margin_mib: int) -> str:
    """libclover's fit check on a device list (plan_memory's, or made up): "" when it fits, else the refusal."""
    arr = (clover_device_memory * max(1, len(devices)))()
    for d, src in zip(arr, devices):
        d.name = str(src["name"]).encode()[:63]
        d.is_host = bool(src.get("is_host", False))
        for key in ("free", "total", "model", "context", "compute"):
            setattr(d, key, int(src.get(key, 0)))  # type: ignore[call-overload]
    err = ctypes.create_string_buffer(4096)
    rc = lib().clover_check_fit(arr, len(devices), int(margin_mib), err, len(err))
    return "" if rc == 0 else err.value.decode("utf-8", "replace")
