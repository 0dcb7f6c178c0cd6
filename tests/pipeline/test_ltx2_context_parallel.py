"""LTX-2's transformer (video and audio streams) split by its own context-parallel plan on real gloo ranks, attention
by each of our methods: its video and audio outputs equal the same transformer in one process (float32), with
sequences that split evenly and unevenly, a text whose padding is masked, and a timestep per video token (image to
video); its blocks compiled as a GPU rank compiles them make one graph for both blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.ltx2 import LTX2, ltx2_context_parallel_plan
from mdtriton.pipeline.context_parallel import split_by_plan
from tests.distributed import run_ranks

METHODS = ("allgather_kv", "ring", "ulysses")
TEXT_WIDTH = 32
AUDIO_CHANNELS = 4  # audio latent channels x latent mel bins, as the pipeline packs them


def transformer() -> LTX2VideoTransformer3DModel:
    """The tiny pipeline's transformer config (mdtriton.testing.tiny_ltx2_pipeline), seeded."""
    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=AUDIO_CHANNELS, audio_out_channels=AUDIO_CHANNELS, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=TEXT_WIDTH,
        rope_double_precision=False, rope_type="split").eval()


def request(frames: int, side: int, audio_frames: int, text_tokens: int, masked: bool) -> dict:
    """A seeded call as LTX2Pipeline makes it (batch 2: with classifier-free guidance), for latents of frames x side x
    side video tokens and audio_frames audio tokens; with masked, the first sample's text has its first three tokens
    padding (left padding, as Gemma's)."""
    generator = torch.Generator().manual_seed(1)
    batch = 2
    mask = torch.ones(batch, text_tokens, dtype=torch.int64)
    if masked:
        mask[0, :3] = 0
    return dict(hidden_states=torch.randn(batch, frames * side * side, 4, generator=generator),
                audio_hidden_states=torch.randn(batch, audio_frames, AUDIO_CHANNELS, generator=generator),
                encoder_hidden_states=torch.randn(batch, text_tokens, TEXT_WIDTH, generator=generator),
                audio_encoder_hidden_states=torch.randn(batch, text_tokens, TEXT_WIDTH, generator=generator),
                timestep=torch.full((batch,), 700.0), sigma=torch.full((batch,), 700.0),
                encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=frames, height=side,
                width=side, fps=25.0, audio_num_frames=audio_frames, use_cross_timestep=True)


def first_frame_kept(call: dict, side: int) -> dict:
    """call as LTX2ImageToVideoPipeline makes it: a timestep per video token, 0 for the first latent frame's (the
    conditioning image's)."""
    timestep = call["timestep"][:, None].repeat(1, call["hidden_states"].shape[1])
    timestep[:, :side * side] = 0
    return {**call, "timestep": timestep, "audio_timestep": call["timestep"]}


# Even: 2 x 4 x 4 video tokens, 6 audio, 8 text; uneven: 3 x 3 x 3 video tokens, 5 audio, 7 text (the first with
# masked text padding), and that with a timestep per video token (image to video).
CALLS = {"even": request(2, 4, 6, 8, masked=False), "uneven": request(3, 3, 5, 7, masked=True)}
CALLS["image-to-video"] = first_frame_kept(CALLS["uneven"], 3)
CASES = [(method, shape) for method in METHODS for shape in CALLS]


def on_ranks(rank: int, world_size: int) -> list:
    """Each case's (video, audio) outputs on this rank."""
    results = []
    for method, shape in CASES:
        comm = Communicator(ParallelPlan(cp_size=world_size, cp_method=method), rank, torch.device("cpu"))
        comm.join_groups()
        model = transformer()
        split_by_plan(model, comm, ltx2_context_parallel_plan(model))
        with torch.no_grad():
            results.append(model(**CALLS[shape], return_dict=False))
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """Each case's outputs on 2 gloo ranks, by its index in CASES."""
    return list(zip(*run_ranks(2, on_ranks)))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{method}-{shape}" for method, shape in CASES])
def test_video_and_audio_equal_one_process(two_ranks, index):
    method, shape = CASES[index]
    with torch.no_grad():
        video, audio = transformer()(**CALLS[shape], return_dict=False)
    for rank_video, rank_audio in two_ranks[index]:
        torch.testing.assert_close(rank_video, video, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(rank_audio, audio, rtol=1e-4, atol=1e-5)


def compiled_on_one_rank(rank: int, world_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """The transformer with its blocks compiled as a rank serving LTX-2 compiles them (LTX2.prepare): its (video,
    audio) outputs for the even call, and the graphs Dynamo made."""
    from torch._dynamo.utils import counters

    model = transformer()
    LTX2.prepare(SimpleNamespace(transformer=model), Communicator.single(), compiled=True)
    with torch.no_grad():
        outputs = model(**CALLS["even"], return_dict=False)
    return outputs, counters["stats"]["unique_graphs"]


def test_compiled_blocks_make_one_graph_for_both_blocks():
    """One compile serves both blocks and equals the eager transformer. The first block takes views (the inputs as
    the transformer reshaped them), the second the first's outputs; with symbolic sizes, Dynamo guards the sizes of a
    view's base, a guard that fails on a tensor with none: every kind of call compiled twice, each compile ten times
    as long as a static one (mdtriton.families.ltx2.LTX2PipelinePart.compile_dynamic)."""
    [(outputs, graphs)] = run_ranks(1, compiled_on_one_rank)
    assert graphs == 1
    with torch.no_grad():
        expected = transformer()(**CALLS["even"], return_dict=False)
    for output, reference in zip(outputs, expected):
        torch.testing.assert_close(output, reference, rtol=1e-4, atol=1e-5)
