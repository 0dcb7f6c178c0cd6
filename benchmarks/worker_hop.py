"""The CPU cost per request of the hop between a Triton stub and its rank worker (backend/tensor_transfer.py).

Each request crosses it twice: the inputs from the stub to the worker, the outputs back, each copied once into
anonymous shared memory, with a small JSON header and the memory's file descriptor over a Unix socket; or, for
inputs that lie in a /dev/shm file (where Triton's Python backend puts a request's inputs), not copied at all: the
header names their place in the file, which the worker maps. This script times that round trip against a real
second process that echoes what it receives, for the tiny model of the tests and for FLUX.1-dev at 4,096 + 512
tokens (bf16), copied and lent, and prints a table.

    python benchmarks/worker_hop.py [--repeats 200]

Whole requests through a real tritonserver, this hop included: benchmarks/serving.py.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from mdtriton.backend.tensor_transfer import TensorLink, layout
from mdtriton.engine.dtypes import TRITON_TYPES
from mdtriton.harness import markdown_table

# A stand-in worker: takes the inputs (as the worker does, in place) and answers with outputs of the asked sizes.
ECHO = """
import sys
import torch
from multiprocessing.connection import Connection
from mdtriton.backend.tensor_transfer import TensorLink, layout
from mdtriton.engine.dtypes import TORCH_DTYPES
link = TensorLink(Connection(int(sys.argv[1])))
# One thread: the stand-in computes nothing, and torch's pool would keep spinning after making the outputs, on the
# cores the other side needs (a worker's compute does that too, on CPU ranks; that is the engine's cost, not the hop's).
torch.set_num_threads(1)
while True:
    try:
        message = link.receive()
    except EOFError:
        break
    outputs = {name: torch.ones(shape, dtype=TORCH_DTYPES[data_type]) for name, data_type, shape in message["outputs"]}
    link.send({"type": "done"}, outputs)
"""


def cases() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """name -> (request inputs, outputs), at the sizes the served models take."""
    bf16 = torch.bfloat16
    flux_inputs = {"hidden_states": torch.randn(1, 4096, 64, dtype=bf16),
                   "encoder_hidden_states": torch.randn(1, 512, 4096, dtype=bf16),
                   "pooled_projections": torch.randn(1, 768, dtype=bf16), "timestep": torch.rand(1, dtype=bf16),
                   "guidance": torch.rand(1, dtype=bf16), "img_ids": torch.zeros(4096, 3), "txt_ids": torch.zeros(512, 3)}
    return {
        "tiny transformer, 2 x 9 x 64 float32": ({"hidden_states": torch.randn(2, 9, 64)}, {"output": torch.randn(2, 9, 64)}),
        "FLUX.1-dev, 4,096 + 512 tokens, bf16": (flux_inputs, {"sample": torch.randn(1, 4096, 64, dtype=bf16)}),
    }


def start_echo(lends_shared_files: bool) -> tuple[subprocess.Popen, TensorLink]:
    ours, theirs = socket.socketpair()
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    return echo, TensorLink(Connection(ours.detach()), lends_shared_files=lends_shared_files)


def in_shared_file(tensors: dict[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """Copies of tensors laid out in a /dev/shm file, as Triton's Python backend lays out a request's inputs."""
    specs, size = layout(tensors)
    path.write_bytes(bytes(size))
    with path.open("r+b") as file:
        memory = mmap.mmap(file.fileno(), size)
    data, placed = torch.frombuffer(memory, dtype=torch.uint8), {}
    for (name, _, _, offset), tensor in zip(specs, tensors.values()):
        end = offset + tensor.numel() * tensor.element_size()
        placed[name] = data[offset:end].view(tensor.dtype).view(tensor.shape)
        placed[name].copy_(tensor)
    return placed, memory


def round_trips(link: TensorLink, inputs: dict, outputs: dict, repeats: int) -> list[float]:
    """Seconds of each round trip (inputs there, outputs back), sorted, after 10 untimed ones."""
    output_specs = [[key, TRITON_TYPES[value.dtype], list(value.shape)] for key, value in outputs.items()]
    seconds = []
    for _ in range(repeats + 10):
        started = time.perf_counter()
        link.send({"type": "job", "outputs": output_specs}, inputs)
        answer = link.receive()
        seconds.append(time.perf_counter() - started)
        assert answer["type"] == "done"
    return sorted(seconds[10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    repeats = parser.parse_args().repeats
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start, {repeats} round trips each")
    table = []
    flux = "FLUX.1-dev, 4,096 + 512 tokens, bf16"
    shared_file = Path(f"/dev/shm/mdtriton-worker-hop-{os.getpid()}")
    rows = [(name, inputs, outputs, False) for name, (inputs, outputs) in cases().items()]
    rows.append((f"{flux}, inputs lent from a /dev/shm file (as the stub does)", *cases()[flux], True))
    try:
        for name, inputs, outputs, lent in rows:
            echo, link = start_echo(lends_shared_files=lent)
            try:
                if lent:
                    inputs, memory = in_shared_file(inputs, shared_file)
                seconds = round_trips(link, inputs, outputs, repeats)
            finally:
                link.close()
                echo.wait(10)
            size = sum(t.numel() * t.element_size() for t in (*inputs.values(), *outputs.values()))
            table.append([name, f"{size / 2**20:.2f} MiB", f"{statistics.median(seconds) * 1e3:.3f} ms",
                          f"{seconds[int(0.9 * len(seconds))] * 1e3:.3f} ms"])
    finally:
        shared_file.unlink(missing_ok=True)
    print(markdown_table(["request", "inputs + outputs", "round trip, median", "p90"], table))


if __name__ == "__main__":
    main()
