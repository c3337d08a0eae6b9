"""``clover-cpp serve``'s start: the model, its template and service, the listening socket, and uvicorn."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from clover_common.errors import BadInput

from .. import options
from ..chat_template import load_template
from . import connections
from .prepare import Defaults
from .routes import create_app
from .security import Endpoints, Limits, Security, loopback_hosts
from .service import CloverService


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BadInput(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise BadInput(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    model = options.open_model(args, n_parallel=args.parallel)  # the --cache-ram budget is shared among the slots
    try:
        template = load_template(model.llama_model, args.model, args.chat_template)
        max_block = model.max_block_size  # the engine's resolution of --max-block-size
        model_id = args.alias or Path(args.model).name.removesuffix(".gguf")
        defaults = Defaults(options.gen_params(args), enable_thinking=args.think == "on",
                            max_tokens=args.max_tokens, seed=args.seed)
        limits = Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                        max_prompt_chars=args.max_prompt_chars, max_queue=args.max_queue,
                        template_timeout_s=args.template_timeout)
        endpoints = Endpoints(slots=args.slots, metrics=args.metrics, props=args.props)
        svc = CloverService(model, template, model_id, max_block, defaults, limits, endpoints)
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        security = Security(api_keys=tuple(args.api_key), allowed_hosts=loopback_hosts(args.host, port))
        shown = f"[{host}]" if ":" in host else host
        print(f"clover-cpp serve: {model_id} (n_ctx {model.n_ctx}, B {model.info.block_size}, mode {args.mode}) "
              f"listening on http://{shown}:{port}", file=sys.stderr, flush=True)
        if template is None:
            print("clover-cpp serve: warning: the model has no chat template; /v1/chat/completions answers 400",
                  file=sys.stderr, flush=True)
        if not args.api_key and security.allowed_hosts is None:
            print(f"clover-cpp serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
                  "port can use the model (docs/serve.md, \"Security\")", file=sys.stderr, flush=True)
        connections.serve(create_app(svc, security), sock, args.timeout,
                          log_level=args.log_level, access_log=args.log_level in ("info", "debug"),
                          timeout_graceful_shutdown=3)
    finally:
        model.close()
    return 0
