"""A request's step cache on diffusers' own transformer (mdtriton.pipeline.generic): diffusers' cache hooks, enabled
for that request only (`enable_cache`, then `disable_cache`), with First Block Cache's decision agreed across the
context-parallel ranks.

diffusers' First Block Cache decides on each rank alone from the first block's residual; split by sequence, each rank
holds only its share of the tokens, so ranks would decide differently and one would run blocks (and their
collectives) that another skips. Here its decision is ours (mdtriton.engine.step_cache.decide): the sums are added
across the context-parallel group before the ratio, so every rank takes the decision one GPU takes for the whole
sequence. TaylorSeer decides by the call count alone, the same on every rank, and runs as diffusers runs it.

Both keep their state per cache context, so they need a pipeline that calls its transformer under `cache_context`
("cond", "uncond"; LTX-2's "cond_uncond": both branches in one doubled batch), or one whose calls we name for it, in
their order in a step (CallNamingHook: FLUX.2 [dev]'s one call, FluxKontextPipeline's conditional then unconditional
one). First Block Cache needs blocks that diffusers' hooks know (its TransformerBlockRegistry), all of one return
layout (the head's output and the tail's are subtracted) and taking diffusers' argument names (its block hooks pass a
skipped block's `hidden_states` and `encoder_hidden_states` through as they are named): a part offers the methods its
pipeline meets (DiffusersPipelinePart.cache_methods; mdtriton.pipeline.any_pipeline.step_cache_offer reads them off
any pipeline).
"""

from __future__ import annotations

import torch
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, ModelHook, TaylorSeerCacheConfig
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK, FBCHeadBlockHook
from torch import nn

from mdtriton.engine.comm import Communicator
from mdtriton.engine.step_cache import FirstBlockCache, TaylorSeer, decide
from mdtriton.pipeline.graphs import set_replaying
from mdtriton.pipeline.guidance import BOTH_BRANCHES

NAMING_HOOK = "mdtriton_cache_context"
# The cache contexts whose calls carry the conditional branch: the steps counted in full_steps.
CONDITIONAL_CONTEXTS = ("cond", BOTH_BRANCHES)


class AgreedHeadBlockHook(FBCHeadBlockHook):
    """diffusers' First Block Cache head hook, deciding with the sums of every context-parallel rank, and counting
    the conditional calls that ran every block."""

    def __init__(self, state_manager, threshold: float, comm: Communicator):
        super().__init__(state_manager, threshold)
        self.comm = comm
        self.full_steps = 0

    @torch.compiler.disable
    def _should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
        previous = self.state_manager.get_state().head_block_residual
        full = decide(hidden_states_residual, previous, self.threshold, self.comm)
        if full and self.state_manager.context.name in CONDITIONAL_CONTEXTS:
            self.full_steps += 1
        return full


class CallNamingHook(ModelHook):
    """Runs each call of a transformer whose pipeline names no cache context under the next of `contexts`, in turn:
    ("cond",) for one call a step, ("cond", "uncond") for a guided step's conditional then unconditional call."""

    def __init__(self, contexts: tuple[str, ...]):
        super().__init__()
        self.contexts = contexts
        self.calls = 0

    def new_forward(self, module: nn.Module, *args, **kwargs):
        name = self.contexts[self.calls % len(self.contexts)]
        self.calls += 1
        # The module's cache_context: guidance parallelism's, where it splits the calls, notes the branch too.
        with module.cache_context(name):
            return self.fn_ref.original_forward(*args, **kwargs)


class DiffusersStepCache:
    """A context manager around one request's pipeline call: the config's cache enabled on the transformer inside,
    disabled after (None: no cache); contexts: the cache contexts to run the calls of each step under, in turn, for a
    pipeline that names none (None: it names its own). A cached call runs without CUDA-graph replay
    (mdtriton.pipeline.graphs): a graph cannot hold First Block Cache's skip, decided from the data, nor TaylorSeer's,
    decided by the call count; the compiled blocks still run."""

    def __init__(self, transformer: nn.Module, config: FirstBlockCache | TaylorSeer | None, comm: Communicator,
                 contexts: tuple[str, ...] | None = None):
        self.transformer = transformer
        self.config = config
        self.comm = comm
        self.contexts = contexts
        self.head: AgreedHeadBlockHook | None = None

    def __enter__(self) -> "DiffusersStepCache":
        if isinstance(self.config, FirstBlockCache):
            self.transformer.enable_cache(FirstBlockCacheConfig(threshold=self.config.threshold))
            self.head = agree_first_block(self.transformer, self.comm)
        elif isinstance(self.config, TaylorSeer):
            self.transformer.enable_cache(TaylorSeerCacheConfig(
                cache_interval=self.config.cache_interval,
                disable_cache_before_step=self.config.disable_cache_before_step,
                disable_cache_after_step=self.config.disable_cache_after_step, max_order=self.config.max_order))
        if self.config is not None:
            set_replaying(self.transformer, False)
            if self.contexts is not None:  # outermost: the guidance split reads the name it sets
                HookRegistry.check_if_exists_or_initialize(self.transformer).register_hook(
                    CallNamingHook(self.contexts), NAMING_HOOK)
        return self

    def __exit__(self, *exception) -> None:
        if self.config is not None:
            # The split's hooks left on the first block wrap only its inputs and outputs (no new_forward of their
            # own), which diffusers' removal of the head from under them keeps right.
            HookRegistry.check_if_exists_or_initialize(self.transformer).remove_hook(NAMING_HOOK, recurse=False)
            self.transformer.disable_cache()
            set_replaying(self.transformer, True)

    def full_steps(self, steps: int) -> int:
        """How many of the request's `steps` ran every block of the conditional call."""
        if isinstance(self.config, FirstBlockCache):
            return self.head.full_steps
        if isinstance(self.config, TaylorSeer):
            return sum(self.config.computes(step) for step in range(steps))
        return steps


def agree_first_block(transformer: nn.Module, comm: Communicator) -> AgreedHeadBlockHook:
    """Replace the head hook that `enable_cache(FirstBlockCacheConfig(...))` put on transformer's first block by one
    that decides with every context-parallel rank's sums, innermost: the split's hooks on that block (a plan that
    splits the first block's inputs: Qwen-Image's, Wan's) run outside it, so that it sees this rank's share of the
    tokens, as the other blocks do."""
    for module in transformer.modules():
        registry = HookRegistry.check_if_exists_or_initialize(module)
        diffusers_head = registry.get_hook(_FBC_LEADER_BLOCK_HOOK)
        if diffusers_head is None:
            continue
        # Taken off the last first (diffusers' remove_hook rewires a hook in the middle wrongly), then put back in
        # their order, the head first.
        others = [(name, registry.get_hook(name)) for name in registry._hook_order if name != _FBC_LEADER_BLOCK_HOOK]
        for name in reversed(list(registry._hook_order)):
            registry.remove_hook(name, recurse=False)
        head = AgreedHeadBlockHook(diffusers_head.state_manager, diffusers_head.threshold, comm)
        registry.register_hook(head, _FBC_LEADER_BLOCK_HOOK)
        for name, hook in others:
            registry.register_hook(hook, name)
        # diffusers sets a cache context on the hooks it finds under the transformer, from a list it keeps.
        HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
        return head
    raise RuntimeError(f"{type(transformer).__name__}: enable_cache put no First Block Cache head hook on its blocks")
