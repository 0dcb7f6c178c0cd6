"""CUDA graphs of diffusers' own transformer's forward on GPU ranks (mdtriton.pipeline.generic): each call the
pipeline makes is replayed from a graph captured at the first call of its kind, its collectives included, as our
engines replay theirs (mdtriton.engine.cuda_graphs). Split by its plan, the forward is launch-bound on GPUs (its hooks
and our attention run eagerly between the compiled blocks): replayed, it is not (docs/benchmarks.md).

A call's kind: the values of its arguments that are not tensors (Qwen-Image's img_shapes, the attention kwargs), and
its tensors' shapes and dtypes. Calls that a graph cannot hold run as they are: over GRAPH_MAX_TOKENS image tokens
(long enough to hide their launches), with a mask tensor (split attention over masked keys selects them on the host),
with positional arguments or arguments of other kinds, or returning a dict, and every call of a request with a step
cache (mdtriton.pipeline.diffusers_cache: its skips are decided as it runs, which a replay cannot follow). The hook sits inside guidance parallelism's
(mdtriton.pipeline.guidance) and outside the split's, so a graph holds one branch's whole forward. A prompt of a new
text length is a new kind: its first call captures (two forwards), which the graphs kept (the most recently used)
repay within a few steps.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from mdtriton.engine.cuda_graphs import GRAPH_MAX_TOKENS, MAX_GRAPHS, CudaGraphForward

log = logging.getLogger(__name__)

GRAPH_HOOK = "mdtriton_cuda_graphs"
PLAIN = (type(None), bool, int, float, str)


def replay_graphs(transformer: nn.Module) -> None:
    """Replay transformer's calls from CUDA graphs where a graph can hold them (register it after the split's hooks
    and before guidance parallelism's)."""
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(GraphHook(), GRAPH_HOOK)
    log.info("%s replays CUDA graphs of its forwards of up to %d image tokens", type(transformer).__name__,
             GRAPH_MAX_TOKENS)


def set_replaying(transformer: nn.Module, replaying: bool) -> None:
    """Replay transformer's calls from graphs (True), or run them as they are (False: the compiled blocks still run)
    until told again; nothing changes for a transformer without graphs."""
    hook = HookRegistry.check_if_exists_or_initialize(transformer).get_hook(GRAPH_HOOK)
    if hook is not None:
        hook.replaying = replaying


class GraphHook(ModelHook):
    """Runs the forward through a CudaGraphForward per kind of call (the MAX_GRAPHS most recently used kinds, each
    with its MAX_GRAPHS most recent shapes)."""

    def __init__(self):
        super().__init__()
        self.graphs: OrderedDict[str, CudaGraphForward] = OrderedDict()
        self.replaying = True

    def new_forward(self, module: nn.Module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        kind = kind_of(args, kwargs) if self.replaying else None
        if kind is None:
            return forward(*args, **kwargs)
        tensors = {name: value for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        others = {name: value for name, value in kwargs.items() if name not in tensors}
        graphs = self.graphs.get(kind)
        if graphs is None:
            graphs = self.graphs[kind] = CudaGraphForward(
                lambda **inputs: {"sample": forward(**inputs, **others)[0]}, MAX_GRAPHS)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(kind)
        return (graphs(tensors)["sample"],)


def kind_of(args: tuple, kwargs: dict) -> str | None:
    """The call's kind (its arguments that are not tensors, as text), or None if a graph cannot hold it."""
    hidden_states = kwargs.get("hidden_states")
    if (args or kwargs.get("return_dict", True) or not isinstance(hidden_states, torch.Tensor)
            or not hidden_states.is_cuda or hidden_states.shape[0] * hidden_states.shape[1] > GRAPH_MAX_TOKENS):
        return None
    parts = []
    for name, value in sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            if "mask" in name:
                return None
        elif plain(value):
            parts.append(f"{name}={value!r}")
        else:
            return None
    return ";".join(parts)


def plain(value) -> bool:
    """Whether value is made of numbers, text, None and lists, tuples and dicts of them (its repr says all of it)."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and plain(item) for key, item in value.items())
    return False
