"""A diffusers pipeline served with no model code of ours: its transformer is diffusers' own module, loaded whole on
every rank with the pipeline's other components and split by sequence as its class declares
(mdtriton.pipeline.context_parallel); the pipeline runs as diffusers runs it.

What each such pipeline still declares (a `DiffusersPipelinePart`) is only its request: the inputs it takes, their
defaults and checks, and how they become the pipeline's call. Context parallelism only: every rank holds the whole
transformer (no tensor parallelism, no FP8 weights of ours), no step cache and no LoRA adapters yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import EngineError
from mdtriton.engine.plan import ParallelPlan
from mdtriton.pipeline.part import PipelinePart


class DiffusersPipelinePart(PipelinePart):
    """A pipeline whose transformer is diffusers' own, split by its `_cp_plan`; subclasses declare the request
    (signature, optional_inputs, check_request, call_arguments, outputs)."""

    transformers = ()  # no transformer engines of ours: diffusers loads the transformer with the rest
    cache_methods = ()

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
        if plan.cfg_size > 1:
            raise EngineError(f"{self.diffusers_class} is not split by guidance here yet: build it with --cfg 1")
        check_plan(transformer_class, config, plan)
        return transformer_class.__name__

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict | None:
        """The plan the transformer is split by (diffusers' `_cp_plan` form), where its class's declared plan needs
        mending for this pipeline's transformer; None: the class's own."""
        return None

    def prepare(self, pipeline: Any, comm: Communicator) -> None:
        """Split the pipeline's transformer across comm's context-parallel group."""
        from mdtriton.pipeline.context_parallel import split_by_plan

        split_by_plan(pipeline.transformer, comm, self.context_parallel_plan(pipeline.transformer))

    def transformer(self, engine: TorchEngine, pipeline: Any) -> torch.nn.Module:
        raise EngineError(f"{self.diffusers_class} serves diffusers' own transformer, not an engine of ours")
