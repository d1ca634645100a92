"""`pagedserve kserve`: a kserve ModelServer serving one pagedserve model.

    pagedserve kserve --model PATH_OR_default --model-name NAME [--host 0.0.0.0]
                      [--http-port 8080] [--grpc-port 8081] [--no-grpc] [--max-model-len N] [engine flags]

Routes: OpenAI (/openai/v1/completions, /chat/completions, /models), Open Inference Protocol v2
(REST and gRPC ModelInfer), v1 :predict, health and readiness, /metrics. Arguments are parsed in
main(); nothing runs at import, and kserve is imported only here and in model.py (it cannot share
a process with tritonclient.grpc, CONTRACTS.md).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.core.cli import _engine_args, engine_config_from_args
from pagedserve.core.errors import PagedServeError

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve kserve", description=__doc__.split("\n\n")[0])
    _engine_args(p)
    p.add_argument("--model-name", default="pagedserve",
                   help="name on the routes (/v2/models/NAME, OpenAI `model`); default: pagedserve")
    p.add_argument("--model-version", default="1", help="the `version` label of the engine metrics")
    p.add_argument("--host", default="0.0.0.0", help="address to bind HTTP and gRPC (127.0.0.1 for local only)")
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--grpc-port", type=int, default=8081)
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    return p


def _bind_host(host: str) -> None:
    """kserve 0.21 hard-codes 0.0.0.0 (HTTP) and [::] (gRPC); make both bind `host` instead."""
    from grpc import aio
    from kserve import model_server
    from kserve.protocol.grpc import server as grpc_server

    class RESTServer(model_server.RESTServer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.config.host = host

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

    _bind_host(args.host)
    model = PagedServeModel(args.model_name, config, version=args.model_version)
    OpenAIServing(args.model_name, model.warm_engine).register(model_server.app)
    REGISTRY.register(EngineMetricsCollector(model.metrics_snapshot, args.model_name, args.model_version))
    ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, enable_grpc=not args.no_grpc,
                workers=1).start([model])
    return 0


if __name__ == "__main__":
    sys.exit(main())
