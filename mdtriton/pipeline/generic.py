"""A diffusers pipeline served with no model code of ours: its transformer is diffusers' own module, loaded whole on
every rank with the pipeline's other components and split by sequence as its class declares
(mdtriton.pipeline.context_parallel), and a guiding pipeline's two calls per step split across the guidance groups
(mdtriton.pipeline.guidance); on GPU ranks its repeated blocks compiled and its forwards replayed from CUDA graphs
(mdtriton.pipeline.graphs). The pipeline runs as diffusers runs it.

What each such pipeline still declares (a `DiffusersPipelinePart`) is only its request: the inputs it takes, their
defaults and checks, how they become the pipeline's call, whether a call guides, and which step cache methods it
offers. A request's step cache runs as diffusers' own cache hooks, enabled for that request only, First Block Cache's
decision agreed across the context-parallel ranks (mdtriton.pipeline.diffusers_cache); its LoRA adapters are merged
into the transformer's weights for that request as into our engines' (mdtriton.lora.weights, by the pipeline engine).
Context and guidance parallelism only: every rank holds the whole transformer (no tensor parallelism, no FP8 weights
of ours).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.part import PipelinePart

log = logging.getLogger(__name__)


class DiffusersPipelinePart(PipelinePart):
    """A pipeline whose transformer is diffusers' own, split by its `_cp_plan`; subclasses declare the request
    (signature, optional_inputs, check_inputs, call_arguments, outputs)."""

    transformers = ()  # no transformer engines of ours: diffusers loads the transformer with the rest
    # Whether a guided step makes both branches' transformer call in one doubled batch (LTX2Pipeline) rather than
    # two calls; guidance parallelism then splits that batch by halves (mdtriton.pipeline.guidance).
    guidance_in_batch: ClassVar[bool] = False
    # diffusers' cache hooks (mdtriton.pipeline.diffusers_cache) keep their state per cache context and know only the
    # blocks diffusers registers: a part whose pipeline calls its transformer under cache_context, or whose calls of a
    # step it names (cache_contexts), offers "taylorseer", and "first_block" where First Block Cache runs its blocks
    # correctly (cache_note says why not).
    cache_methods = ()
    # Whether prepare compiles the transformer's repeated blocks with symbolic sizes (compile_blocks: a new image size
    # compiles nothing) or static ones (each new size of a kind of call compiles once more).
    compile_dynamic: ClassVar[bool] = True

    def check_build(self, pipeline_dir: Path, plan: ParallelPlan, data_type: str) -> str:
        """The transformer's class name, after checking (EngineError, before anything is written) that plan can
        split it and data_type is one it runs in."""
        config_path = Path(pipeline_dir) / "transformer" / "config.json"
        if not config_path.is_file():
            raise EngineError(f"{pipeline_dir}: no transformer/config.json; a {self.diffusers_class} directory holds "
                              "its transformer")
        config = json.loads(config_path.read_text())
        # Imported here, as the pipeline engine imports diffusers: only a pipeline's build and load need it.
        import diffusers

        from mdtriton.pipeline.context_parallel import check_plan

        transformer_class = getattr(diffusers, config.get("_class_name", ""), None)
        if transformer_class is None:
            raise EngineError(f"{config_path}: diffusers has no transformer class {config.get('_class_name')!r}")
        if data_type not in ("FP32", "BF16", "FP16"):
            raise EngineError(f"{self.diffusers_class} runs in FP32, BF16 or FP16 (diffusers' own modules), not "
                              f"{data_type}")
        if plan.cfg_size > 1 and not self.guidance_branches:
            raise EngineError(f"{self.diffusers_class} has no guidance branches to run on separate ranks: build it "
                              "with --cfg 1")
        check_plan(transformer_class, config, plan)
        return transformer_class.__name__

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict | None:
        """The plan the transformer is split by (diffusers' `_cp_plan` form), where its class's declared plan needs
        mending for this pipeline's transformer; None: the class's own."""
        return None

    def prepare(self, pipeline: Any, comm: Communicator, compiled: bool) -> None:
        """Split the pipeline's transformer across comm's context-parallel group; if compiled, compile its repeated
        blocks and, on GPUs, replay its forwards from CUDA graphs; split its guided steps' two calls across the
        guidance groups (that hook outermost, the split's innermost)."""
        from mdtriton.pipeline.context_parallel import split_by_plan
        from mdtriton.pipeline.graphs import replay_graphs
        from mdtriton.pipeline.guidance import split_by_guidance

        transformer = pipeline.transformer
        split_by_plan(transformer, comm, self.context_parallel_plan(transformer))
        if compiled:
            compile_blocks(transformer, self.compile_dynamic)
            if comm.device.type == "cuda":
                replay_graphs(transformer)
        split_by_guidance(transformer, comm, self.guidance_in_batch)

    def before_call(self, pipeline: Any, arguments: dict) -> None:
        """Tell guidance parallelism whether this call guides (makes an unconditional transformer call each step)."""
        from mdtriton.pipeline.guidance import set_guided

        set_guided(pipeline.transformer, self.guides(pipeline, arguments))

    def guides(self, pipeline: Any, arguments: dict) -> bool:
        """Whether the pipeline called with arguments (call_arguments') makes a conditional and an unconditional
        transformer call each step; a part with guidance_branches says when."""
        return False

    def cache_contexts(self, pipeline: Any, arguments: dict) -> tuple[str, ...] | None:
        """The cache contexts a cached call's transformer calls run under, in turn within each step, for a pipeline
        that names none (mdtriton.pipeline.diffusers_cache.CallNamingHook); None, the default: it names its own."""
        return None

    def transformer(self, engine: TorchEngine, pipeline: Any) -> torch.nn.Module:
        raise EngineError(f"{self.diffusers_class} serves diffusers' own transformer, not an engine of ours")


def compile_blocks(transformer: torch.nn.Module, dynamic: bool = True) -> None:
    """Compile the transformer's repeated blocks (diffusers' `_repeated_blocks`, as its `compile_repeated_blocks` does:
    one compiled code serves every block of a kind) with symbolic sizes, or static ones where dynamic is False
    (DiffusersPipelinePart.compile_dynamic); the split's hooks and our attention run eagerly in between (graph breaks).
    The first call of each kind compiles (the first request's first step); deterministic (Inductor times no kernel
    choices), so a healed rank computes the same bits."""
    if not getattr(transformer, "_repeated_blocks", None):
        log.info("%s names no repeated blocks: it runs eagerly", type(transformer).__name__)
        return
    transformer.compile_repeated_blocks(dynamic=dynamic, options={"deterministic": True})
    log.info("%s: its repeated blocks compiled (%s)%s", type(transformer).__name__,
             ", ".join(transformer._repeated_blocks), "" if dynamic else ", static sizes")
