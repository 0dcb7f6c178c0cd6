"""The `mdtriton` command: build engines, serve them, and query them."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import tempfile
from pathlib import Path

from mdtriton import __version__
from mdtriton.build_tools import lora_cli
from mdtriton.client import cli as client_cli
from mdtriton.client.grpc_client import ClientError
from mdtriton.engine.manifest import EngineError
from mdtriton.server import TRITON_PORTS, ServerError, TritonServer, port_is_free
from mdtriton.stub_environment import StubEnvironmentError

# Errors that are the user's to fix: shown as one line, exit code 1 (anything else keeps its traceback).
USER_ERRORS = (ClientError, EngineError, ServerError, StubEnvironmentError, ValueError, OSError)

# Commands whose modules import torch (`pip install "mdtriton[server]"`), with their one-line help. Their parsers are
# built, and their modules imported, only when one of them is run: the client commands start in a fraction of a
# second and work where torch is not installed.
ENGINE_COMMANDS = {
    "build": ("mdtriton.build_tools.cli", "build an engine into MODEL_REPOSITORY/NAME/VERSION"),
    "verify": ("mdtriton.build_tools.verify", "check a model version's weight files, SHA-256 included"),
    "demo": ("mdtriton.demo", "build, serve and query a small multi-rank model end to end"),
    "bench": ("mdtriton.bench", "measure a transformer engine on 1..N GPUs per parallel method"),
}


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model repository with the embedded Triton server",
        description="Start the Triton Inference Server shipped in the nvidia-pytriton wheel on MODEL_REPOSITORY, "
                    "wait until it is ready, print its addresses as the last line, and stop on Ctrl-C/SIGTERM. It "
                    "takes Triton's usual ports (HTTP 8000, gRPC 8001, metrics 8002), where the client commands look "
                    "by default, when they are free, and says so when it must take others. Triton's own log goes to "
                    "a file whose path it prints (--log-to-stdout: to this terminal).")
    parser.add_argument("repository", type=Path, help="model repository directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default 8001, or a free one if it is taken)")
    parser.add_argument("--http-port", type=int, help="HTTP port (default 8000, or a free one if it is taken)")
    parser.add_argument("--metrics-port", type=int,
                        help="Prometheus metrics port (default 8002, or a free one if it is taken)")
    parser.add_argument("--model-control-mode", choices=("none", "poll", "explicit"), default="none",
                        help="Triton's model control mode (default none: load every model at start)")
    parser.add_argument("--load-model", action="append", default=[], help="with explicit mode: a model to load at start")
    parser.add_argument("--log-to-stdout", action="store_true",
                        help="show Triton's log here instead of writing it to a file")
    parser.set_defaults(run=serve)


def usual_ports(args: argparse.Namespace) -> dict[str, int | None]:
    """The port of each endpoint: the one given, else Triton's usual one if it is free, else None (a free one, picked
    by TritonServer); one line says which usual ports were taken."""
    ports, taken = {}, []
    for endpoint, usual in TRITON_PORTS.items():
        given = getattr(args, f"{endpoint}_port")
        if given is not None:
            ports[endpoint] = given
        elif port_is_free(args.host, usual):
            ports[endpoint] = usual
        else:
            ports[endpoint] = None
            taken.append(f"{usual} ({endpoint})")
    if taken:
        print(f"Triton's usual port(s) {', '.join(taken)} taken on {args.host}: serving on free ones instead (see the "
              "last line; give the client commands --url)", flush=True)
    return ports


def serve(args: argparse.Namespace) -> int:
    ports = usual_ports(args)
    log_file = None
    if not args.log_to_stdout:
        log_file = Path(tempfile.mkdtemp(prefix="mdtriton-serve-")) / "tritonserver.log"
        print(f"Triton's log: {log_file}", flush=True)
    server = TritonServer(args.repository, args.host, ports["grpc"], ports["http"], ports["metrics"],
                          args.model_control_mode, tuple(args.load_model), log_file=log_file)
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


def add_engine_parser(subparsers, name: str, command: str | None) -> None:
    """The parser of an engine command: whole (its module imported) if it is the command to run, else a line of
    help."""
    module, help_line = ENGINE_COMMANDS[name]
    if name != command:
        subparsers.add_parser(name, help=help_line, add_help=False)
        return
    try:
        importlib.import_module(module).add_parser(subparsers)
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        sys.exit(f"error: mdtriton {name} needs torch: pip install \"mdtriton[server]\" (the client commands do not)")


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `mdtriton` parser. Of the engine commands (ENGINE_COMMANDS) only `command`'s parser is built whole."""
    parser = argparse.ArgumentParser(prog="mdtriton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mdtriton {__version__}")
    subparsers = parser.add_subparsers(required=True, metavar="COMMAND")
    add_engine_parser(subparsers, "build", command)
    add_engine_parser(subparsers, "verify", command)
    add_serve_parser(subparsers)
    client_cli.add_parsers(subparsers)
    lora_cli.add_parser(subparsers)
    add_engine_parser(subparsers, "demo", command)
    add_engine_parser(subparsers, "bench", command)
    return parser


def engine_errors() -> tuple[type[Exception], ...]:
    """The user errors of the engine commands, from their modules (which import torch: an engine command has loaded
    them already)."""
    from mdtriton.build_tools.build import BuildInterrupted
    from mdtriton.build_tools.checkpoint import CheckpointError
    from mdtriton.engine.fp8 import Fp8Unsupported

    return BuildInterrupted, CheckpointError, Fp8Unsupported


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    args = make_parser(command).parse_args(argv)
    try:
        return args.run(args)
    except Exception as error:
        if not isinstance(error, USER_ERRORS + (engine_errors() if command in ENGINE_COMMANDS else ())):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
