"""Guidance parallelism for a diffusers transformer called as its pipeline calls it: the conditional and the
unconditional call of each guided step run at once, one on each guidance group of ranks (cfg_size 2), and every rank
gets both outputs from one exchange (Communicator.cfg_all_gather).

A guiding pipeline (QwenImagePipeline, Flux2KleinPipeline, ...) calls its transformer under
`cache_context("cond")`, then under `cache_context("uncond")`, and combines the two outputs only after both calls
(our Wan family relies on the same order); one that names no cache context (FluxKontextPipeline) makes the same two
calls in the same order, so a guided step's first call is its conditional one. So the conditional call hands back a
tensor not yet filled and keeps its inputs; the unconditional call runs the conditional inputs on guidance group 0
and its own on group 1, exchanges the outputs, fills the conditional call's tensor and returns its own. The pipeline
may slice the conditional output before the unconditional call (a view, filled with it), but must not compute with
it: a pipeline that does is not declared as guiding (`DiffusersPipelinePart.guidance_branches`). Whether a request
guides (a negative prompt, a scale over 1) is known from its call arguments before the pipeline runs; one that does
not makes no unconditional call, and both groups then run every call alike.

A pipeline that guides in one call of a doubled batch instead (LTX2Pipeline: the unconditional samples, then the
conditional ones, under `cache_context("cond_uncond")`) has that call split by halves of its batch: each guidance group
runs its half of every batched input, and one exchange gives every rank the whole output. Its other calls (LTX-2's
spatio-temporal and modality guidance, a batch of one branch) run alike on both groups.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from mdtriton.engine.comm import Communicator

log = logging.getLogger(__name__)

GUIDANCE_HOOK = "mdtriton_guidance"
BOTH_BRANCHES = "cond_uncond"  # the cache context of a call whose doubled batch holds both branches


def split_by_guidance(transformer: nn.Module, comm: Communicator, in_batch: bool = False) -> None:
    """Run transformer's conditional and unconditional calls on the two guidance groups (nothing changes with
    cfg_size 1); in_batch: the pipeline makes both in one call of a doubled batch, split by halves. Its hook is
    outermost: the context-parallel split (mdtriton.pipeline.context_parallel) runs inside each group's call."""
    if comm.cfg_size == 1:
        return
    hook = (BatchGuidanceHook if in_batch else GuidanceHook)(comm, transformer.cache_context)
    transformer.cache_context = hook.cache_context  # the pipeline names each call's branch
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(hook, GUIDANCE_HOOK)
    log.info("%s split by guidance: this rank runs the %s branch", type(transformer).__name__,
             "conditional" if comm.cfg_rank == 0 else "unconditional")


def set_guided(transformer: nn.Module, guided: bool) -> None:
    """Tell a transformer split by guidance whether the next request makes an unconditional call each step; no
    conditional call is pending then (a failed request's)."""
    hook = HookRegistry.check_if_exists_or_initialize(transformer).get_hook(GUIDANCE_HOOK)
    if hook is not None:
        hook.guided, hook.pending, hook.branch = guided, None, None


class GuidanceHook(ModelHook):
    """Defers each guided step's conditional call to its unconditional one, then runs one branch per guidance group."""

    def __init__(self, comm: Communicator, cache_context):
        super().__init__()
        self.comm = comm
        self.diffusers_cache_context = cache_context
        self.guided = False
        self.branch: str | None = None
        self.pending: tuple[tuple, dict, torch.Tensor] | None = None

    @contextmanager
    def cache_context(self, name: str, **step):
        """The transformer's cache_context: notes the call's branch, then sets diffusers' own context."""
        self.branch = name
        with self.diffusers_cache_context(name, **step):
            yield

    def new_forward(self, module: nn.Module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        if not self.guided:
            return forward(*args, **kwargs)
        if kwargs.get("return_dict", True):
            raise NotImplementedError("guidance parallelism takes a transformer called with return_dict=False, as "
                                      "diffusers' pipelines call it")
        # A pipeline that names no branch: a call with none pending is the step's conditional one.
        branch = self.branch or ("uncond" if self.pending is not None else "cond")
        if branch == "cond":
            hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            # A flow model's prediction has its latents' shape; checked once the branch has run.
            filled = torch.empty(hidden_states.shape, dtype=module.dtype, device=hidden_states.device)
            self.pending = (args, kwargs, filled)
            return (filled,)
        if branch != "uncond" or self.pending is None:
            raise RuntimeError(f"a guided step called the transformer in cache context {branch!r} without a "
                               "conditional call before it; guidance parallelism takes a pipeline that calls it under "
                               "'cond', then 'uncond'")
        conditional_args, conditional_kwargs, filled = self.pending
        self.pending = None
        mine = "cond" if self.comm.cfg_rank == 0 else "uncond"
        with self.diffusers_cache_context(mine):
            output = (forward(*conditional_args, **conditional_kwargs) if mine == "cond"
                      else forward(*args, **kwargs))[0]
        if output.shape != filled.shape or output.dtype != filled.dtype:
            raise RuntimeError(f"{type(module).__name__}'s output ({tuple(output.shape)}, {output.dtype}) is not "
                               f"shaped as its latents ({tuple(filled.shape)}, {filled.dtype}): guidance parallelism "
                               "cannot serve it; build it with --cfg 1")
        both = self.comm.cfg_all_gather(output)
        filled.copy_(both[0])
        return (both[1],)


class BatchGuidanceHook(GuidanceHook):
    """Splits a guided call of both branches in one doubled batch (cache context BOTH_BRANCHES) by halves: guidance
    group g runs the g-th half of every input batched as hidden_states is; the outputs are all-gathered whole."""

    def new_forward(self, module: nn.Module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        if not self.guided or self.branch != BOTH_BRANCHES:
            return forward(*args, **kwargs)
        if args or kwargs.get("return_dict", True):
            raise NotImplementedError("guidance parallelism by halves of a batch takes a transformer called with "
                                      "keywords and return_dict=False, as diffusers' LTX-2 pipelines call it")
        batch = kwargs["hidden_states"].shape[0]
        if batch % self.comm.cfg_size:
            raise RuntimeError(f"a guided call of both branches has a batch of {batch}, not a doubled one; guidance "
                               "parallelism cannot split it: build the model with --cfg 1")
        share = batch // self.comm.cfg_size
        start = self.comm.cfg_rank * share
        mine = {name: value[start:start + share]
                if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch else value
                for name, value in kwargs.items()}
        return tuple(self.comm.cfg_all_gather(output).flatten(0, 1) for output in forward(**mine))
