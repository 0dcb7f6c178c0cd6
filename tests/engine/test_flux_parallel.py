"""Multi-rank FLUX engines (tensor, context and both) against the one-rank engine, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.families.flux.layers import joined, modulation_shares
from mdtriton.families.flux.transformer import Flux, JointSlice
from tests.distributed import run_ranks
from tests.engine.plans import PLANS
from tests.engine.flux_cases import fan_in_scaled_weights, flux_inputs, max_relative_error, run_engines, write_engine

# (text, image) token counts: 15 divides by neither 2 nor 4; 16 splits text across ranks; with 5 tokens on
# 4 ranks the last rank holds only padding and the one before it a real token and padding.
SEQUENCES = [(5, 10), (4, 12), (2, 3)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_engines_match_one_rank(tmp_path, world_size):
    config = FLUX.default_config()
    weights = fan_in_scaled_weights(config, seed=1)
    cases = [flux_inputs(config, text_len, image_len, seed=i) for i, (text_len, image_len) in enumerate(SEQUENCES)]

    one_rank = write_engine(tmp_path / "one_rank", config, ParallelPlan(), weights)
    reference = TorchEngine.load(one_rank, Manifest.read(one_rank), FLUX, Communicator.single())
    expected = [reference.forward(inputs)["sample"] for inputs in cases]

    engine_dirs = {}
    for plan in PLANS[world_size]:
        name = f"tp{plan.tp_size}_cp{plan.cp_size}" + (f"_{plan.cp_method}" if plan.cp_size > 1 else "")
        engine_dirs[name] = str(write_engine(tmp_path / name, config, plan, weights))
    per_rank = run_ranks(world_size, run_engines, engine_dirs, cases)

    for rank, results in enumerate(per_rank):
        for name, samples in results.items():
            for (text_len, image_len), sample, want in zip(SEQUENCES, samples, expected):
                got = torch.from_numpy(sample)
                assert got.shape == want.shape, f"{name}, rank {rank}, text {text_len} + image {image_len}"
                error = max_relative_error(got, want)
                assert error < 1e-5, f"{name}, rank {rank}, text {text_len} + image {image_len}: error {error:.2e}"


@pytest.mark.parametrize("tp_size, cp_size", [(1, 3), (2, 4)])
def test_ulysses_with_indivisible_heads_says_what_to_use(tp_size, cp_size):
    plan = ParallelPlan(tp_size=tp_size, cp_size=cp_size, cp_method="ulysses")
    with pytest.raises(ValueError, match="use cp_method allgather_kv or ring"):
        FLUX.check_plan(FLUX.default_config(), plan)
    with pytest.raises(ValueError, match="use cp_method allgather_kv or ring"), torch.device("meta"):
        Flux(FLUX.default_config(), Communicator(plan, 0, torch.device("cpu")))
    FLUX.check_plan(FLUX.default_config(), ParallelPlan(tp_size=tp_size, cp_size=cp_size, cp_method="ring"))


def test_heads_indivisible_by_tp_size_is_refused():
    with pytest.raises(ValueError, match="num_attention_heads 4 does not divide by tp_size 3"):
        FLUX.check_plan(FLUX.default_config(), ParallelPlan(tp_size=3))


@pytest.mark.parametrize("text_len, image_len", [(5, 10), (4, 12), (2, 3), (7, 0)])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_joint_slices_cover_the_sequence_once(text_len, image_len, cp_size):
    """Rank slices, in rank order, are the text tokens, then the image tokens, then the padding."""
    text, image, padding = [], [], 0
    for cp_rank in range(cp_size):
        tokens = JointSlice.of(text_len, image_len, Communicator(ParallelPlan(cp_size=cp_size), cp_rank, "cpu"))
        text += range(*tokens.text_range())
        image += range(*tokens.image_range())
        padding += tokens.padding()
        held = len(range(*tokens.text_range())) + len(range(*tokens.image_range())) + tokens.padding()
        assert held == tokens.local_len
    assert text == list(range(text_len)) and image == list(range(image_len))
    assert padding == -(text_len + image_len) % cp_size


def modulations_on_rank(rank: int, world_size: int, widths: list[int]) -> list[torch.Tensor]:
    comm = Communicator(ParallelPlan(cp_size=world_size, cp_method="ring"), rank, torch.device("cpu"))
    comm.join_groups()
    torch.manual_seed(0)  # the same linears and temb on every rank
    linears = [torch.nn.Linear(6, width) for width in widths]
    temb = torch.randn(2, 6)
    with torch.no_grad():
        shares = modulation_shares(temb, linears, comm)
        return [(joined(share, linear.out_features), linear(torch.nn.functional.silu(temb)))
                for share, linear in zip(shares, linears)]


def test_modulations_computed_in_shares_equal_each_linear_whole():
    """Each of 3 ranks computes a third of every modulation (7 and 8 entries: the last shares padded) and gathers."""
    for rank_results in run_ranks(3, modulations_on_rank, [7, 8, 3]):
        for got, want in rank_results:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the GEMM of a share may round otherwise
