"""Step caching: skip transformer work between denoising steps as diffusers' cache hooks do, the same on every rank.

A request picks its cache with the `cache` input, a JSON object (read by `read_cache`):

- `{"method": "first_block", "threshold": 0.05}`: diffusers' First Block Cache (`FirstBlockCacheConfig`). Every
  step runs the first transformer block; its output's residual (output minus input, of the image or video tokens)
  is compared with the one of the last step that ran every block: if the mean absolute change relative to the mean
  magnitude is at most `threshold`, the other blocks are skipped and their residual from that step is added
  instead. Under context parallelism each rank holds some of the tokens, so the two sums are added across the
  context-parallel ranks before the ratio is taken (`decide`): every rank takes the one-GPU decision, and none runs a
  block (and its collectives) that another skips.
- `{"method": "taylorseer", "cache_interval": 5, "disable_cache_before_step": 3, "disable_cache_after_step": null,
  "max_order": 1}`: diffusers' TaylorSeer (`TaylorSeerCacheConfig`, its default modules: every attention); refused
  by families whose transformer does not offer it.
- `{"method": "none"}`: every step runs every block (the default unless the model was built with `--cache`).

Fields left out take diffusers' defaults. The state of a request's cache lives only as long as the request
(`StepCache`), one per cache context (a pipeline's conditional and unconditional branches), so nothing carries over
to the next request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.request_json import read_json


@dataclass(frozen=True)
class FirstBlockCache:
    """diffusers' FirstBlockCacheConfig."""

    method: ClassVar[str] = "first_block"
    threshold: float = 0.05


@dataclass(frozen=True)
class TaylorSeer:
    """diffusers' TaylorSeerCacheConfig (its Taylor factors in bfloat16, as diffusers' default keeps them)."""

    method: ClassVar[str] = "taylorseer"
    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1

    def computes(self, step: int) -> bool:
        """Whether a module's call number `step` (from 0) computes, as diffusers' TaylorSeerCacheHook decides."""
        warm_up = step < self.disable_cache_before_step
        interval = (step - self.disable_cache_before_step - 1) % self.cache_interval == 0
        cool_down = self.disable_cache_after_step is not None and step >= self.disable_cache_after_step
        return warm_up or interval or cool_down


CacheConfig = FirstBlockCache | TaylorSeer
TAYLOR_FACTORS_DTYPE = torch.bfloat16  # TaylorSeerCacheConfig's default taylor_factors_dtype
METHODS: dict[str, type[CacheConfig] | None] = {"none": None, "first_block": FirstBlockCache, "taylorseer": TaylorSeer}
EXAMPLE = '{"method": "first_block", "threshold": 0.08}'


def read_cache(text: str) -> CacheConfig | None:
    """The cache config of a `cache` JSON text (None: no cache); ValueError naming the field and what to send."""
    given = read_json(text, "cache", f"send an object such as {EXAMPLE}")
    if not isinstance(given, dict):
        raise ValueError(f"cache is {json_kind(given)}, not a JSON object; send one such as {EXAMPLE}")
    method = given.pop("method", None)
    if method not in METHODS:
        raise ValueError(f"cache method {method!r} is not one of {', '.join(METHODS)}")
    config_class = METHODS[method]
    known = [f.name for f in fields(config_class)] if config_class else []
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ValueError(f"cache field(s) {', '.join(unknown)} unknown to method {method!r}; its fields are "
                         f"{', '.join(known) or 'none'}")
    if config_class is None:
        return None
    for name, value in given.items():
        check_field(name, value)
    return config_class(**given)


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words (for messages): "null", "an array", "a string", ..."""
    kinds = ((type(None), "null"), (bool, "true or false"), (list, "an array"), (str, "a string"),
             ((int, float), "a number"), (dict, "an object"))
    return next(kind for types, kind in kinds if isinstance(value, types))


def check_field(name: str, value) -> None:
    """ValueError unless value is in range for field `name`."""
    if name == "threshold":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"cache threshold {value!r} is not a finite number >= 0; send e.g. 0.08")
        return
    if name == "disable_cache_after_step" and value is None:
        return
    least = 1 if name == "cache_interval" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"cache {name} {value!r} is not an integer >= {least}")


@dataclass
class FirstBlockState:
    """One cache context's First Block Cache: the first block's residual and the other blocks' residual at the last
    step that ran every block."""

    residual: torch.Tensor | None = None
    rest: torch.Tensor | None = None


@dataclass
class TaylorSeerState:
    """One cache context's TaylorSeer: the calls so far (`step`, from 0), the last that computed, and each cached
    output's Taylor factors (by order, in bfloat16) and data type."""

    step: int = -1
    last_update: int | None = None
    factors: list[dict[int, torch.Tensor]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)

    def update(self, outputs: list[torch.Tensor], max_order: int) -> None:
        """New factors from the outputs computed at this step: diffusers' recursive divided differences."""
        factors = []
        for index, features in enumerate(outputs):
            new = {0: features}
            if self.last_update is not None:
                delta = self.step - self.last_update
                previous = self.factors[index]
                for order in range(max_order):
                    if order not in previous:
                        break
                    new[order + 1] = (new[order] - previous[order].to(features.dtype)) / delta
            factors.append({order: factor.to(TAYLOR_FACTORS_DTYPE) for order, factor in new.items()})
        self.factors, self.dtypes, self.last_update = factors, [output.dtype for output in outputs], self.step

    def predict(self) -> list[torch.Tensor]:
        """Each output at this step, from its Taylor expansion around the last step that computed."""
        offset = self.step - self.last_update
        outputs = []
        for factors, dtype in zip(self.factors, self.dtypes):
            output = torch.zeros_like(factors[0], dtype=dtype)
            for order in range(len(factors)):
                output = output + factors[order].to(dtype) * (offset**order / math.factorial(order))
            outputs.append(output)
        return outputs


@dataclass
class StepCache:
    """A request's step cache for one transformer on one rank: its config (None: no cache), the state of each cache
    context, and how many calls of the conditional context ("cond", the only one without guidance) ran every block."""

    config: CacheConfig | None
    states: dict[str, FirstBlockState | TaylorSeerState] = field(default_factory=dict)
    context: str = "cond"
    full_steps: int = 0

    def forward(self, run, inputs: dict[str, torch.Tensor], comm: Communicator) -> dict[str, torch.Tensor]:
        """The transformer's outputs of inputs, its parts run by `run` (mdtriton.engine.cuda_graphs.eager_forward's
        signature) as the config's method says."""
        if self.config is None:
            self.count(True)
            return run(inputs)
        if isinstance(self.config, TaylorSeer):
            return self.taylorseer(run, inputs)
        state = self.states.setdefault(self.context, FirstBlockState())
        head = run(inputs, "first_block")
        residual, first = head.pop("residual"), head.pop("hidden")
        full = decide(residual, state.residual, self.config.threshold, comm)
        self.count(full)
        if not full:
            return run(inputs, "finish", {**head, "hidden": first + state.rest})
        outputs = run(inputs, "other_blocks", head)
        state.residual, state.rest = residual, outputs.pop("hidden") - first
        return outputs

    def taylorseer(self, run, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """TaylorSeer on every attention (diffusers' default modules): each call either computes them, keeping their
        outputs to update the Taylor factors, or runs with their outputs predicted from the factors. Every attention
        is called once per transformer call, so all of them compute at the same calls, as diffusers' hooks decide."""
        state = self.states.setdefault(self.context, TaylorSeerState())
        state.step += 1
        full = self.config.computes(state.step)
        self.count(full)
        if not full:
            predicted = state.predict()
            return run(inputs, "given_attention", {f"attention.{i}": tensor for i, tensor in enumerate(predicted)})
        outputs = run(inputs, "keep_attention")
        kept = [outputs.pop(f"attention.{i}") for i in range(sum(name.startswith("attention.") for name in outputs))]
        state.update(kept, self.config.max_order)
        return outputs

    def count(self, full: bool) -> None:
        if full and self.context == "cond":
            self.full_steps += 1


def decide(residual: torch.Tensor, previous: torch.Tensor | None, threshold: float, comm: Communicator) -> bool:
    """First Block Cache's decision: whether the other blocks must run. residual and previous are this rank's tokens
    of the first block's residual now and at the last full step; the sums of |residual - previous| and |previous| are
    added over the context-parallel ranks (the tensor-parallel ranks hold the same tokens), so the ratio is that of the
    whole sequence's means, as one GPU computes it."""
    if previous is None:
        return True
    sums = torch.stack(((residual - previous).abs().float().sum(), previous.abs().float().sum()))
    change, magnitude = comm.cp_all_reduce(sums).tolist()
    return change / magnitude > threshold
