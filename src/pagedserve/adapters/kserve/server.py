"""`pagedserve kserve`: a kserve ModelServer serving one pagedserve model.

    pagedserve kserve --model PATH_OR_default --model-name NAME [--host 0.0.0.0]
                      [--http-port 8080] [--grpc-port 8081] [--no-grpc] [--api-key KEY]
                      [--tool-call-parser hermes|llama3_json|mistral]
                      [--enable-lora --lora-modules NAME=PATH ... [--allow-runtime-lora-updating]]
                      [--max-model-len N] [engine and limit flags]

Routes: OpenAI (/openai/v1/completions, /chat/completions, /models, and the same under /v1, vLLM's
paths; `GET /v1/models` is also KServe's v1 model list; with LoRA, `model` names the base model or an
adapter, and vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter), /health (vLLM's), Open Inference Protocol v2
(REST and gRPC ModelInfer), v1 :predict, health and readiness, /metrics. Arguments are parsed in
main(); nothing runs at import, and kserve is imported only here and in model.py (it cannot share
a process with tritonclient.grpc, docs/contracts.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

from pagedserve.adapters.process_exit import exit_without_teardown
from pagedserve.adapters.kserve.guards import API_KEY_ENV
from pagedserve.adapters.kserve.tool_calls import add_tool_call_parser_arg
from pagedserve.core.errors import PagedServeError
from pagedserve.tools.engine_args import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve kserve", description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--model-name", default="pagedserve",
                   help="name on the routes (/v2/models/NAME, OpenAI `model`); default: pagedserve")
    p.add_argument("--model-version", default="1", help="the `version` label of the engine metrics")
    p.add_argument("--host", default="0.0.0.0", help="address to bind HTTP and gRPC (127.0.0.1 for local only)")
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--grpc-port", type=int, default=8081)
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on the OpenAI routes (default: ${API_KEY_ENV}, "
                        "if set; else no key)")
    add_tool_call_parser_arg(p)
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which turns them on too); needs --enable-lora")
    return p


def _patch_rest_server(host: str, on_shutdown_signal: Callable[[], None]) -> None:
    """kserve 0.21 hard-codes 0.0.0.0 (HTTP) and [::] (gRPC); make both bind `host` instead.
    And start the drain the moment uvicorn takes SIGTERM/SIGINT: uvicorn stops accepting
    connections at once (so readiness probes fail) and waits for the open ones."""
    from grpc import aio
    from kserve import model_server
    from kserve.protocol.grpc import server as grpc_server

    class RESTServer(model_server.RESTServer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.config.host = host
            uvicorn_handle_exit = self._server.handle_exit

            def handle_exit(sig, frame) -> None:
                on_shutdown_signal()
                uvicorn_handle_exit(sig, frame)

            self._server.handle_exit = handle_exit  # looked up when uvicorn installs its handlers

    grpc_host = f"[{host}]" if ":" in host else host

    class GrpcAio:  # stands in for grpc.aio inside kserve's gRPC server module
        def __getattr__(self, name: str):
            return getattr(aio, name)

        @staticmethod
        def server(*args, **kwargs):
            server = aio.server(*args, **kwargs)
            add_port = server.add_insecure_port
            server.add_insecure_port = lambda address: add_port(address.replace("[::]", grpc_host, 1))
            return server

    model_server.RESTServer = RESTServer
    if host not in ("0.0.0.0", "::"):
        grpc_server.aio = GrpcAio()


def _install_guards(app, limits, api_key: str | None) -> None:
    """Body size limit and API key in front of every route; HTTP status and Retry-After for the
    v1/v2 routes' overload and drain answers (kserve's own error handler always answers 500)."""
    from fastapi.responses import JSONResponse

    from pagedserve.adapters.kserve.guards import RequestGuard
    from pagedserve.adapters.kserve.model import HTTPStatusError

    async def status_error(_request, exc: HTTPStatusError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)

    app.add_middleware(RequestGuard, max_request_bytes=limits.max_request_bytes, api_key=api_key)
    app.add_exception_handler(HTTPStatusError, status_error)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = engine_config_from_args(args)
    except (PagedServeError, OSError, ValueError) as exc:
        print(f"pagedserve kserve: error: {exc}", file=sys.stderr)
        return 2
    # kserve parses sys.argv when imported (and would read --model as its --model_name): hide ours.
    sys.argv = sys.argv[:1]
    from kserve import ModelServer, model_server
    from prometheus_client import REGISTRY

    from pagedserve.adapters.kserve.metrics import EngineMetricsCollector
    from pagedserve.adapters.kserve.model import PagedServeModel
    from pagedserve.adapters.kserve.openai_routes import OpenAIServing
    from pagedserve.adapters.kserve.served_models import ServedModels, runtime_updating_allowed
    from pagedserve.adapters.kserve.tokenize_routes import TokenizeServing

    # A dead engine stops the server the way SIGTERM does (drain, exit), so the platform restarts it.
    model = PagedServeModel(args.model_name, config, version=args.model_version,
                            on_engine_dead=lambda: os.kill(os.getpid(), signal.SIGTERM))
    _patch_rest_server(args.host, model.begin_drain)
    _install_guards(model_server.app, config.limits, args.api_key or os.environ.get(API_KEY_ENV))
    models = ServedModels(args.model_name, model.warm_engine, lora_enabled=config.lora.enable_lora,
                          allow_runtime_updating=runtime_updating_allowed(args.allow_runtime_lora_updating))
    OpenAIServing(args.model_name, model.warm_engine, args.tool_call_parser, models).register(model_server.app)
    TokenizeServing(args.model_name, model.warm_engine, models).register(model_server.app)  # vllm-router's routing
    REGISTRY.register(EngineMetricsCollector(model.metrics_snapshot, args.model_name, args.model_version,
                                             lambda: model.llm.model_info if model.llm is not None else None,
                                             model.lora_stats))
    # uvicorn's own graceful-shutdown timeout is a backstop a little past the drain period.
    grace = int(config.limits.drain_timeout) + 5
    ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, enable_grpc=not args.no_grpc,
                workers=1, grace_period=grace).start([model])
    if model.engine_failed:
        print("pagedserve kserve: the engine failed; exiting so that the platform restarts the server",
              file=sys.stderr)
        _exit_without_teardown(1)
    _exit_without_teardown(0)
    return 0  # not reached


def _exit_without_teardown(code: int) -> None:
    """Exit once the servers have stopped and the engine is shut down (kserve unloads the model,
    whose stop() ends the engine thread), skipping the interpreter's own teardown: freeing torch,
    transformers and the engine's objects one by one returns nothing to the system that the exit
    does not, and it took 4-5 s of an idle server's 4.3-5.4 s from SIGTERM to exit here (the
    servers were down 0.1 s after the signal). Logs and output are flushed first."""
    exit_without_teardown(code)


if __name__ == "__main__":
    sys.exit(main())
