"""A pipeline's prompt encoding on one rank (mdtriton.pipeline.encoder), on 2 real gloo ranks: what rank 0's
encode_prompt returns reaches rank 1 with its data types and shapes (None entries too); what cannot be broadcast is
refused naming the pipeline; what each rank of FLUX.2 [dev] logs of its text encoder as it loads. (Served, FLUX.2 [dev]:
tests/pipeline/test_image_pipelines.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux2 import FLUX2, FLUX2_KLEIN
from mdtriton.pipeline.encoder import broadcast_outputs, check_outputs
from mdtriton.pipeline.engine import log_encoding
from tests.distributed import run_ranks


def encoding() -> tuple[torch.Tensor | None, ...]:
    """Outputs of the kinds an encode_prompt returns: embeddings, token ids, a mask, an absent one, a scalar."""
    embeddings = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3).to(torch.bfloat16)
    return (embeddings, torch.arange(20, dtype=torch.int64).reshape(1, 5, 4), torch.tensor([[True, False]]), None,
            torch.tensor(2.5))


def _received(rank: int, world_size: int) -> tuple:
    comm = Communicator(ParallelPlan(cp_size=2, cp_method="ulysses"), rank, torch.device("cpu"))
    comm.join_groups()
    return broadcast_outputs(comm, encoding() if rank == 0 else None, None)


def test_rank_0s_outputs_reach_every_rank_with_their_data_types_and_shapes():
    for received in run_ranks(2, _received):
        assert len(received) == len(encoding())
        for got, sent in zip(received, encoding()):
            assert (got is None and sent is None) or (got.dtype == sent.dtype and torch.equal(got, sent))


@pytest.mark.parametrize("outputs", [torch.ones(2), [torch.ones(2)], (torch.ones(2), "text"),
                                     (torch.ones(2, dtype=torch.complex64),)])
def test_what_cannot_be_broadcast_is_refused_naming_the_pipeline(outputs):
    with pytest.raises(TypeError, match="Flux2Pipeline.encode_prompt returned"):
        check_outputs(outputs, "Flux2Pipeline")


@pytest.mark.parametrize("part, plan, rank, said", [
    (FLUX2, ParallelPlan(cp_size=2, cp_method="ring"), 1,
     "the pipeline loaded without its text_encoder: rank 0 encodes each request's prompts and broadcasts them"),
    (FLUX2, ParallelPlan(cp_size=2, cp_method="ring"), 0, None),
    (FLUX2, ParallelPlan(cp_size=2, cp_method="ulysses", elastic=True), 1,
     "every rank holds the text_encoder: an elastic model's jobs run on groups of ranks that may not hold rank 0, so "
     "each group encodes its own prompts"),
    (FLUX2_KLEIN, ParallelPlan(cp_size=2, cp_method="ring"), 1, None),
])
def test_each_rank_says_where_the_text_encoder_is(caplog, part, plan, rank, said):
    """Rank 1 of FLUX.2 [dev] loads without it; an elastic model's ranks keep it, and say why; [klein] keeps it and
    says nothing."""
    comm = Communicator(plan, rank, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="mdtriton.pipeline.engine"):
        log_encoding(part, comm, part.components_not_on(plan, rank))
    assert caplog.messages == ([said] if said else [])
