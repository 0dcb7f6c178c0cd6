"""The base of a family's adapter that a diffusers pipeline calls as its transformer: a transformer engine with
the attributes pipelines read of their transformer (dtype, device, cache_context), the request's step cache and its
agreement point (mdtriton.engine.job_control), and guidance parallelism for a pipeline's two calls per guided step."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from mdtriton.engine.dtypes import TORCH_DTYPES
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.job_control import JobAgreement
from mdtriton.engine.step_cache import StepCache


class EngineAsTransformer(torch.nn.Module):
    """A transformer engine in a diffusers pipeline's `transformer` slot; subclasses give `config` (what the pipeline
    reads of its transformer's config) and `forward` (the diffusers model's call)."""

    def __init__(self, engine: TorchEngine):
        super().__init__()
        self.engine = engine
        self._dtype = TORCH_DTYPES[engine.manifest.data_type]
        self.step_cache: StepCache | None = None  # the request's, set by the pipeline engine while it runs
        self.agreement: JobAgreement | None = None  # the job's, set likewise: the ranks agree before the first call
        self.pending: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None  # a guided step's conditional call

    @property
    def device(self) -> torch.device:
        return self.engine.comm.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def cache_context(self, name: str, **step):
        """Pipelines name each transformer call's cache context (a guidance branch: "cond", "uncond"), each with a
        step cache state of its own."""
        if self.step_cache is not None:
            self.step_cache.context = name
        return nullcontext()

    def before_collectives(self) -> None:
        """Wait, at a job's first call, for every rank to agree that none failed before it: call it before any of the
        engine's work that has collectives (run_engine does)."""
        if self.agreement is not None:
            self.agreement.before_collectives()

    def run_engine(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The engine's sample for inputs, through the request's step cache (after the agreement point)."""
        self.before_collectives()
        return self.engine.forward(inputs, self.step_cache)["sample"]

    def run_guided(self, inputs: dict[str, torch.Tensor], branch: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A guided step's call under guidance parallelism (cfg_size 2), for a pipeline that calls its transformer for
        the conditional branch, then for the unconditional one, and combines them only after both: the conditional
        call hands back an empty tensor of shape (its output's) and keeps its inputs; the unconditional call runs the
        conditional inputs on guidance group 0 and its own on group 1, at once, exchanges the outputs (one
        all-gather), fills the conditional call's tensor and returns its own."""
        if branch == "cond":
            self.pending = (inputs, torch.empty(shape, dtype=self._dtype, device=self.device))
            return self.pending[1]
        if self.pending is None:
            raise RuntimeError(f"a guided step called the transformer for its {branch!r} branch without a conditional "
                               "call before it; guidance parallelism takes a pipeline that calls the conditional "
                               "branch, then the unconditional one")
        (conditional, filled), self.pending = self.pending, None
        comm = self.engine.comm
        # Each guidance group runs one branch, in that branch's step cache context.
        EngineAsTransformer.cache_context(self, "cond" if comm.cfg_rank == 0 else "uncond")
        both = comm.cfg_all_gather(self.run_engine(conditional if comm.cfg_rank == 0 else inputs))
        filled.copy_(both[0])
        return both[1]
