"""`mdtriton infer`: send one request to a served model and print or save its outputs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from mdtriton.client.grpc_client import Client


def read_input(text: str) -> tuple[str, np.ndarray]:
    name, sep, path = text.partition("=")
    if not sep:
        raise SystemExit(f"error: --input takes NAME=FILE.npy, got {text!r}")
    return name, np.load(path, allow_pickle=False)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("infer", help="send one inference request over gRPC",
                                   description="Send one request to a model and print (or save) its outputs.")
    parser.add_argument("model", help="model name")
    parser.add_argument("--url", default="127.0.0.1:8001", help="server gRPC address (default 127.0.0.1:8001)")
    parser.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input tensor (repeat)")
    parser.add_argument("--output-dir", type=Path, help="save each output as NAME.npy here instead of printing it")
    parser.add_argument("--timeout", type=float, help="seconds to wait for the answer")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    inputs = dict(read_input(text) for text in args.input)
    with Client(args.url, timeout=args.timeout) as client:
        start = time.perf_counter()
        outputs = client.infer(args.model, inputs, version=args.model_version)
        latency = time.perf_counter() - start
    for name, array in outputs.items():
        if args.output_dir:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            np.save(args.output_dir / f"{name}.npy", array)
            print(f"{name}: {array.dtype} {list(array.shape)} -> {args.output_dir / f'{name}.npy'}")
        else:
            print(f"{name}: {array.dtype} {list(array.shape)}\n{array}")
    print(f"latency: {latency * 1000:.1f} ms")
    return 0
