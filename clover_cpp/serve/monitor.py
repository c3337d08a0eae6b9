"""llama-server's monitoring endpoints, with its response shapes (tools/server/README.md of the pinned llama.cpp, and
its tools/server/server-context.cpp where the two differ): ``GET /props`` (plus a ``clover`` object), ``POST
/props``, ``GET /slots`` and ``GET /metrics`` (metrics.py's text). As in llama-server, /slots is on unless
``--no-slots``, /metrics and changing props need ``--metrics`` and ``--props``; each answers a 501 otherwise, and
all need the API key (llama-server's only open paths are /health and its web UI)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clover_native import cpu, loader
from ..gen_params import GenParams, resolved
from ..model import ModelInfo
from .metrics import CONTENT_TYPE
from .security import Endpoints
from .worker import Job

if TYPE_CHECKING:
    from .service import CloverService

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "a random seed for each request"
MEDIA_MARKER = "<__media__>"  # llama-server's is random per process; no media reaches this server (modalities)
SAMPLERS = ["temperature", "top_k", "top_p"]  # the engine's sampling chain, in its order (clover-sampling.cpp)


def _not_supported(what: str, flag: str) -> JSONResponse:
    """llama-server's answer for an endpoint it was not started with (format_error_response,
    ERROR_TYPE_NOT_SUPPORTED), with this server's error keys."""
    return JSONResponse({"error": {"message": f"This server does not support {what}. Start it with `{flag}`",
                                   "type": "not_supported_error", "param": None, "code": 501}}, status_code=501)


def _speculative(mode: str) -> bool:
    """Whether a request of this mode drafts tokens and verifies them: spec's block drafts, auto's n-gram and block
    drafts (llama-server: a slot with a draft model or n-gram drafts)."""
    return mode in ("spec", "auto")


def _params(gen: GenParams, info: ModelInfo, n_predict: int, seed: int, full: bool) -> dict[str, Any]:
    """llama-server's task parameters (``task_params::to_json``): ``full`` for /props, the shorter form for /slots,
    both with the README's older ``speculative.n_max/n_min/p_min``. Clover samples with ``SAMPLERS`` and the
    penalties only: llama.cpp's other samplers are given at the values that turn them off. Not recorded by a job,
    and given as the server's defaults: ``stream``, the stop strings (only ``ignore_eos`` is kept), the chat and
    reasoning formats (clover_cpp/output_parser.py reads reasoning into ``reasoning_content``, as llama.cpp's
    ``deepseek`` format does)."""
    spec = _speculative(gen.mode)
    used = resolved(gen, info)  # the GGUF's values where the job gives none
    only = (lambda **kv: kv) if full else (lambda **kv: {})  # the fields of the full form only
    return {
        "seed": seed, "temperature": gen.temperature, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": gen.top_k, "top_p": gen.top_p, "min_p": 0.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
        "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": -1,  # the penalties count the response only
        "repeat_penalty": used.repeat_penalty, "presence_penalty": used.presence_penalty,
        "frequency_penalty": used.frequency_penalty,
        "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 0,
        **only(dry_sequence_breakers=[]), "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
        "adaptive_target": -1.0, "adaptive_decay": 0.9, **only(stop=[]),
        "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
        "ignore_eos": gen.stop_ids == (), "stream": False,
        "n_probs": gen.logprobs or 0, "min_keep": 0,
        **only(logit_bias=[[t, b if b != float("-inf") else False] for t, b in gen.logit_bias]),
        **only(grammar=gen.grammar or "", grammar_lazy=bool(gen.grammar_after_ids), grammar_triggers=[],
               preserved_tokens=[]),
        "chat_format": "Content-only", "reasoning_format": "deepseek", "reasoning_in_content": False,
        "generation_prompt": "", "samplers": SAMPLERS,
        "speculative.types": f"clover-{gen.mode}" if spec else "none",
        "speculative.n_max": used.block_size if spec else 0, "speculative.n_min": 0,
        "speculative.p_min": 0.0, "timings_per_token": False, "post_sampling_probs": False,
        "backend_sampling": False, "lora": [],
    }


# ------------------------------------------------------------------------------------------ GET /props
def _token_text(svc: CloverService, which: str) -> str:
    """The vocabulary's BOS or EOS token as text ("" when it has none), as llama-server gives them."""
    L = loader.llama()
    token = getattr(L, f"llama_vocab_{which}")(L.llama_model_get_vocab(svc.model.llama_model))
    return svc.model.token_piece(token).decode("utf-8", "replace") if token >= 0 else ""


def _ftype(svc: CloverService) -> str:
    L = loader.llama()
    name = L.llama_ftype_name(L.llama_model_ftype(svc.model.llama_model))
    return name.decode() if name else ""


def _build_info() -> str:
    """llama-server's ``b<build number>-<commit>`` lives in llama.cpp's common library, which this server does not
    load (and a build of the pinned sdist has no git: it would say b0-unknown); the build's BUILD_INFO key and
    its llama.cpp sdist say which build this is instead."""
    info = cpu.read_build_info(loader.lib_dir().parent)
    sdist = info.get("sdist", "").rsplit("/", 1)[-1] or "unknown sdist"
    return f"clover-{info.get('key', 'unknown')[:12]} ({sdist})"


def _clover(svc: CloverService) -> dict[str, Any]:
    """What a request that sets none of them decodes with, and the model's clover settings."""
    info, d = svc.model.info, svc.prepare.defaults
    gen = resolved(d.gen, info)
    return {"mode": gen.mode, "block_size": gen.block_size, "threshold": gen.threshold,
            "coreset_top_p": gen.coreset_top_p,
            "max_block_size": svc.max_block_size, "enable_thinking": d.enable_thinking,
            "n_parallel": svc.worker.n_slots, "n_ctx": svc.model.n_ctx, "n_ctx_train": info.n_ctx_train,
            "gguf": {"block_size": info.block_size, "threshold": info.threshold,
                     "coreset_top_p": info.coreset_top_p, "mask_token_id": info.mask_token_id,
                     "history_rows": info.history_rows, "conv_right_kernel": info.conv_right_kernel,
                     "has_block_diffusion": info.has_block_diffusion,
                     "calibrated_block_sizes": list(info.calibrated_block_sizes),
                     "calibrated_thresholds": list(info.calibrated_thresholds), "n_vocab": info.n_vocab}}


def _default_settings(svc: CloverService) -> dict[str, Any]:
    """/props' ``default_generation_settings``: the README's idle slot 0 with the server's defaults."""
    d = svc.prepare.defaults
    seed = LLAMA_DEFAULT_SEED if d.seed is None else d.seed
    n_predict = -1 if d.max_tokens is None else d.max_tokens  # -1: what the context leaves
    return {"id": 0, "id_task": -1, "n_ctx": svc.model.n_ctx, "speculative": _speculative(d.gen.mode),
            "is_processing": False, "params": _params(d.gen, svc.model.info, n_predict, seed, full=True), "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                           "stopping_word": ""}}


def props(svc: CloverService, endpoints: Endpoints, ui: bool) -> dict[str, Any]:
    """llama-server's ``get_res_props`` and the README's fields, and ``clover``. ``ui``: the web chat is served."""
    template = svc.prepare.template
    return {
        "default_generation_settings": _default_settings(svc),
        "total_slots": svc.worker.n_slots,
        "model_alias": svc.model_id,
        "model_ftype": _ftype(svc),
        "model_path": svc.model.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": endpoints.slots,
        "endpoint_props": endpoints.props,
        "endpoint_metrics": endpoints.metrics,
        "ui": ui,
        "ui_settings": {},
        "chat_template": template.source if template is not None else "",
        "chat_template_caps": {},  # llama.cpp probes its own Jinja engine for these; this server has no such probe
        "bos_token": _token_text(svc, "bos"),
        "eos_token": _token_text(svc, "eos"),
        "build_info": _build_info(),
        "is_sleeping": False,  # the server never unloads its model
        "cors_proxy_enabled": False,
        "clover": _clover(svc),
    }


# ------------------------------------------------------------------------------------------ GET /slots
def _next_token(svc: CloverService, job: Job | None) -> list[dict[str, Any]]:
    """A slot's ``next_token``: a list of one object, as llama-server sends it (its README shows the object
    alone). An idle slot keeps nothing of its last job's budget, as llama-server's."""
    if job is None:
        return [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]
    generated = list(job.generated)
    text = svc.model.detokenize(generated, special=False)
    return [{"has_next_token": True, "has_new_line": "\n" in text, "n_remain": job.params.max_tokens - len(generated),
             "n_decoded": len(generated)}]


def _slot(svc: CloverService, i: int, running: Job | None) -> dict[str, Any]:
    """One slot as llama-server's ``server_slot::to_json`` (without --slots-debug): its running job, else its last
    one, else only the slot; and the job's ``clover`` settings and, once finished, its stats."""
    job = running or svc.meter.last.get(i)
    mode = job.params.mode if job is not None else svc.prepare.defaults.gen.mode
    out: dict[str, Any] = {"id": i, "n_ctx": svc.model.n_ctx, "speculative": _speculative(mode),
                           "is_processing": running is not None}
    if job is None:
        return out
    p = job.params
    return {**out, "id_task": svc.meter.task_id(job), "n_prompt_tokens": len(job.prompt_ids),
            "n_prompt_tokens_processed": len(job.prompt_ids) - job.cached_tokens, "n_prompt_tokens_cache":
            job.cached_tokens, "params": _params(p, svc.model.info, p.max_tokens, p.seed, full=False),
            "next_token": _next_token(svc, running),
            "clover": {"mode": p.mode, "block_size": p.block_size, "threshold": p.threshold,
                       "stats": job.stats.to_dict() if job.stats is not None else None}}


def slots(svc: CloverService) -> list[dict[str, Any]]:
    """Every slot, in order."""
    running = {j.slot: j for j in svc.worker.jobs if j.started and not j.finished}
    return [_slot(svc, i, running.get(i)) for i in range(svc.worker.n_slots)]


# ------------------------------------------------------------------------------------------ routes
def add_routes(app: FastAPI, svc: CloverService) -> None:
    """GET/POST /props, GET /slots, GET /metrics on ``svc.endpoints``' switches."""
    on = svc.endpoints

    @app.get("/props")
    async def get_props(request: Request) -> dict[str, Any]:
        ui = any(getattr(r, "path", None) == "/" for r in request.app.router.routes)
        return props(svc, on, ui)

    @app.post("/props")
    async def post_props() -> Any:
        if not on.props:
            return _not_supported("changing global properties", "--props")
        return {"success": True}  # llama-server has no property to change yet either

    @app.get("/slots")
    async def get_slots(fail_on_no_slot: str = "") -> Any:
        if not on.slots:
            return _not_supported("slots endpoint", "--slots")
        body = slots(svc)
        if fail_on_no_slot and all(s["is_processing"] for s in body):
            return JSONResponse({"error": {"message": "no slot available", "type": "unavailable_error",
                                           "param": None, "code": 503}}, status_code=503)
        return body

    @app.get("/metrics")
    async def get_metrics() -> Response:
        if not on.metrics:
            return _not_supported("metrics endpoint", "--metrics")
        return Response(svc.meter.render(), headers={"Content-Type": CONTENT_TYPE,  # no "; charset" appended
                                                     "Process-Start-Time-Unix": str(int(svc.meter.started))})
