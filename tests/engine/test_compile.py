"""Compiled engines (what GPU ranks run) against eager ones, on real gloo ranks: the compiled regions give the same
answers, the warm-up at load leaves nothing to compile for later requests of other lengths and batch sizes, and
what was compiled is kept in the engine directory."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from mdtriton.engine.comm import Communicator
from mdtriton.engine.compile import CACHE_DIR
from mdtriton.engine.cuda_graphs import GRAPH_MAX_TOKENS, MAX_GRAPHS
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.engine.step_cache import FirstBlockCache, StepCache, TaylorSeer
from mdtriton.families.flux import FLUX
from tests.distributed import run_ranks
from tests.engine.flux_cases import fan_in_scaled_weights, flux_inputs, max_relative_error, write_engine

# (batch, text tokens, image tokens): none of them the warm-up's, and batch sizes on both sides of 1.
CASES = [(1, 5, 10), (3, 4, 12), (2, 7, 30)]


def compiled_against_eager(rank: int, world_size: int, engine_dir: str) -> tuple[list[float], int, float]:
    manifest = Manifest.read(engine_dir)
    comm = Communicator(manifest.plan, rank, torch.device("cpu"))
    comm.join_groups()
    eager = TorchEngine.load(engine_dir, manifest, FLUX, comm, compile=False)
    compiled = TorchEngine.load(engine_dir, manifest, FLUX, comm, compile=True)
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    errors = []
    for seed, (batch, text_len, image_len) in enumerate(CASES):
        inputs = flux_inputs(FLUX.default_config(), text_len, image_len, batch=batch, seed=seed)
        errors.append(max_relative_error(compiled.forward(inputs)["sample"], eager.forward(inputs)["sample"]))
    return errors, counters["stats"]["unique_graphs"] - graphs_after_warm_up, compiled.warm_up_seconds


def test_compiled_tensor_parallel_engine_matches_eager_and_never_compiles_after_load(tmp_path):
    config = FLUX.default_config()
    engine_dir = write_engine(tmp_path / "engine", config, ParallelPlan(tp_size=2), fan_in_scaled_weights(config, seed=3))
    results = run_ranks(2, compiled_against_eager, str(engine_dir), timeout=540)
    for errors, new_graphs, warm_up_seconds in results:
        assert max(errors) < 1e-5, errors
        assert new_graphs == 0, "a request after the warm-up compiled again"
        assert warm_up_seconds > 0
    kept = sorted(path.name for path in (engine_dir / CACHE_DIR).iterdir())
    assert [name.endswith(f"-rank{rank}.bin") for rank, name in enumerate(kept)] == [True, True], kept


def test_a_rehearsal_communicates_nothing_and_keeps_every_shape():
    """Before the ranks meet (no process group exists), a rank can run its model alone: every collective returns
    a tensor of the shape the real one would."""
    comm = Communicator(ParallelPlan(tp_size=2, cp_size=2, cp_method="ring"), 3, torch.device("cpu"))
    x = torch.randn(2, 6, 4, 3)
    with comm.rehearsal():
        assert comm.tp_all_reduce(x.clone()).shape == x.shape
        assert comm.cp_all_gather(x, dim=2).shape == (2, 6, 8, 3)
        received = torch.full_like(x, 7.0)
        comm.ring_shift([x], [received]).wait()
        gathered = torch.full((2, *x.shape), 7.0)
        comm.cp_all_gather_into(gathered, x).wait()
        assert bool((received == 7).all()) and bool((gathered == 7).all())  # nothing was sent or received
        assert comm.broadcast(x, src=0) is x
    try:
        comm.tp_all_reduce(x)
    except (RuntimeError, ValueError) as error:  # outside a rehearsal the collective is real: no group here
        assert "rehears" not in str(error)
    else:
        raise AssertionError("an all-reduce without a process group succeeded outside a rehearsal")


@pytest.mark.gpu
def test_a_gpu_engine_replays_short_requests_as_cuda_graphs_with_the_same_answers(tmp_path):
    """A compiled engine on a GPU captures a graph at the first request of each short shape and replays it; the
    answers equal the compiled module's own, bit for bit, and requests over GRAPH_MAX_TOKENS run without graphs."""
    config = FLUX.default_config()
    engine_dir = write_engine(tmp_path / "engine", config, ParallelPlan(), fan_in_scaled_weights(config, seed=3))
    comm = Communicator.single(torch.device("cuda", 0))
    engine = TorchEngine.load(engine_dir, Manifest.read(engine_dir), FLUX, comm)
    long_request = (1, 16, GRAPH_MAX_TOKENS)
    for seed, (batch, text_len, image_len) in enumerate([*CASES, CASES[0], long_request]):
        inputs = flux_inputs(config, text_len, image_len, batch=batch, seed=seed)
        served = engine.forward(inputs)["sample"]
        with torch.inference_mode():
            direct = engine.module(**{name: tensor.cuda() for name, tensor in inputs.items()})["sample"]
        assert torch.equal(served, direct)
    # The two most recent short shapes; none for the long one.
    assert len(engine.run.graphs["forward"].graphs) == MAX_GRAPHS


@pytest.mark.gpu
def test_step_cache_parts_replay_graphs_of_their_own_and_answer_as_the_forward(tmp_path):
    """On a GPU the step cache's parts (First Block Cache's three, TaylorSeer's two) replay CUDA graphs of their own
    through the compiled blocks. With the same inputs twice, a step that skips the other blocks (or predicts every
    attention from the step before, max_order 0) gives the forward's answer again, up to rounding."""
    config = FLUX.default_config()
    engine_dir = write_engine(tmp_path / "engine", config, ParallelPlan(), fan_in_scaled_weights(config, seed=3))
    engine = TorchEngine.load(engine_dir, Manifest.read(engine_dir), FLUX, Communicator.single(torch.device("cuda", 0)))
    inputs = flux_inputs(config, 7, 30, seed=1)
    expected = engine.forward(inputs)["sample"]
    always = StepCache(FirstBlockCache(threshold=-1.0))
    assert max_relative_error(engine.forward(inputs, always)["sample"], expected) < 1e-6
    # TaylorSeer keeps its factors in bfloat16, as diffusers does: the predicted attentions are rounded to 8 bits.
    for cache, bound in ((StepCache(FirstBlockCache(threshold=math.inf)), 1e-4),
                         (StepCache(TaylorSeer(cache_interval=5, disable_cache_before_step=1, max_order=0)), 2e-2)):
        answers = [engine.forward(inputs, cache)["sample"] for _ in range(2)]
        assert cache.full_steps == 1  # the second call skipped (or predicted)
        errors = [max_relative_error(answer, expected) for answer in answers]
        print(f"{type(cache.config).__name__}: relative errors {errors}")
        assert max(errors) < bound
    assert set(engine.run.graphs) == {"forward", "first_block", "other_blocks", "finish", "keep_attention",
                                      "given_attention"}
