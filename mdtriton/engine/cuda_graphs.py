"""CUDA graphs of whole forwards: one capture per input signature, replayed to skip per-kernel launch costs.

A FLUX forward launches thousands of kernels, with gaps between them; a captured graph replays them all at once.
With several ranks the graph holds the collectives too: every rank captures the same job's forward together (this
needs NCCL without blocking waits, and no timing events recorded into the capture: backend/job_timer.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Requests of up to this many tokens (batch x sequence) replay graphs: on one H200 a graph saved 5.3 ms of a
# 141 ms FLUX.1-dev forward at 4,096+512 tokens (3.8%) and 0.9% at 16,384+512 (docs/benchmarks.md), while
# each graph keeps the memory of its forward's activations for as long as it is kept.
GRAPH_MAX_TOKENS = 8192
# Graphs kept at once, the most recently used: a server's requests come at a few sizes (image resolutions).
MAX_GRAPHS = 2

Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


@dataclass
class CapturedForward:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class CudaGraphForward:
    """Runs function(**inputs) (a module, or a part of its forward) by replaying a graph captured for the inputs'
    shapes and dtypes.

    Keeps the `max_graphs` most recently used graphs; each holds its own memory pool, freed when evicted.
    """

    def __init__(self, function: Callable[..., dict[str, torch.Tensor]], max_graphs: int):
        self.function = function
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Signature, CapturedForward] = OrderedDict()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        signature = tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items())
        captured = self.graphs.get(signature)
        if captured is None:
            captured = self._capture(inputs)
            self.graphs[signature] = captured
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(signature)
            for name, tensor in inputs.items():
                captured.inputs[name].copy_(tensor)
        captured.graph.replay()
        return {name: tensor.clone() for name, tensor in captured.outputs.items()}

    def _capture(self, inputs: dict[str, torch.Tensor]) -> CapturedForward:
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        # One eager run on a side stream first: kernels pick their algorithms and libraries make their handles
        # outside the capture, as CUDA graphs require.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.function(**static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.function(**static_inputs)
        return CapturedForward(graph, static_inputs, outputs)


class GraphedForward:
    """How a compiled engine runs on a GPU: requests of up to GRAPH_MAX_TOKENS tokens replay a CUDA graph captured
    at the first request of their shape (a capture runs the forward twice, no compile); longer requests, whose
    kernels are long enough to hide their launches, run the module as it is. Called as eager_forward is: the whole
    forward, or one of its parts that First Block Cache runs apart (each part with graphs of its own)."""

    def __init__(self, module: torch.nn.Module, tokens_of: Callable[[dict[str, torch.Tensor]], int],
                 group_of: Callable[[], tuple[int, ...]]):
        """group_of: the ranks the running job spans (an elastic plan's job runs on a group of them: a graph holds
        the collectives of the group it was captured on, so each group has graphs of its own)."""
        self.module = module
        self.tokens_of = tokens_of
        self.group_of = group_of
        self.graphs: dict[tuple[str, tuple[int, ...]], CudaGraphForward] = {}

    def __call__(self, inputs: dict[str, torch.Tensor], part: str = "forward",
                 carried: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        function = module_part(self.module, part)
        tensors = {**inputs, **(carried or {})}
        if self.tokens_of(inputs) > GRAPH_MAX_TOKENS:
            return function(**tensors)
        key = (part, self.group_of())
        if key not in self.graphs:
            self.graphs[key] = CudaGraphForward(function, MAX_GRAPHS)
        return self.graphs[key](tensors)


def eager_forward(module: torch.nn.Module):
    """How a module runs requests without graphs: run(inputs, part, carried) calls the module's `part` ("forward", or
    a First Block Cache part: "first_block", "other_blocks", "finish") with the request's inputs and what earlier
    parts returned."""

    def run(inputs: dict[str, torch.Tensor], part: str = "forward",
            carried: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return module_part(module, part)(**inputs, **(carried or {}))

    return run


def module_part(module: torch.nn.Module, part: str) -> Callable[..., dict[str, torch.Tensor]]:
    return module if part == "forward" else getattr(module, part)
