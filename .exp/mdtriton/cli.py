"""The `mdtriton` command: build engines, serve them, and query them."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from mdtriton import __version__
from mdtriton.build_tools.build import BuildInterrupted
from mdtriton.build_tools.checkpoint import CheckpointError
from mdtriton.client.grpc_client import ClientError
from mdtriton.engine.fp8 import Fp8Unsupported
from mdtriton.engine.manifest import EngineError
from mdtriton.server import ServerError
from mdtriton.stub_environment import StubEnvironmentError

# Errors that are the user's to fix: shown as one line, exit code 1 (anything else keeps its traceback).
USER_ERRORS = (BuildInterrupted, CheckpointError, ClientError, EngineError, Fp8Unsupported, ServerError,
               StubEnvironmentError, ValueError, OSError)


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model repository with the embedded Triton server",
        description="Start the Triton Inference Server shipped in the nvidia-pytriton wheel on MODEL_REPOSITORY, "
                    "wait until it is ready, print its addresses, stream its log, and stop on Ctrl-C/SIGTERM.")
    parser.add_argument("repository", type=Path, help="model repository directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default: a free one)")
    parser.add_argument("--http-port", type=int, help="HTTP port (default: a free one)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus metrics port (default: a free one)")
    parser.add_argument("--model-control-mode", choices=("none", "poll", "explicit"), default="none",
                        help="Triton's model control mode (default none: load every model at start)")
    parser.add_argument("--load-model", action="append", default=[], help="with explicit mode: a model to load at start")
    parser.set_defaults(run=serve)


def serve(args: argparse.Namespace) -> int:
    from mdtriton.server import TritonServer

    server = TritonServer(args.repository, args.host, args.grpc_port, args.http_port, args.metrics_port,
                          args.model_control_mode, tuple(args.load_model))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.start()
        print(f"ready: gRPC {server.grpc_address}  HTTP {server.http_address}  metrics {server.metrics_url}", flush=True)
        server.process.wait()
        return server.process.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping the server", flush=True)
        server.stop()


def main(argv: list[str] | None = None) -> int:
    from mdtriton import bench, demo
    from mdtriton.build_tools import cli as build_cli
    from mdtriton.build_tools import lora_cli, verify
    from mdtriton.client import cli as client_cli

    parser = argparse.ArgumentParser(prog="mdtriton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mdtriton {__version__}")
    subparsers = parser.add_subparsers(required=True, metavar="COMMAND")
    build_cli.add_parser(subparsers)
    verify.add_parser(subparsers)
    add_serve_parser(subparsers)
    client_cli.add_parsers(subparsers)
    lora_cli.add_parser(subparsers)
    demo.add_parser(subparsers)
    bench.add_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
