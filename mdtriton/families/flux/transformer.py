"""The FLUX.1 diffusion transformer (diffusers' FluxTransformer2DModel),
tensor-parallel by heads and context-parallel by tokens of the joint [text; image] sequence.

Parameter names equal diffusers' state-dict keys, so a diffusers checkpoint loads without conversion.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mdtriton.engine.attention import attention_for, packed_attention_for
from mdtriton.engine.comm import Communicator
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux.blocks import FluxSingleTransformerBlock, FluxTransformerBlock, Modulation
from mdtriton.families.flux.layers import (AdaLayerNormContinuous, TimeTextEmbedding, modulation_shares,
                                           rotary_embedding)

# FLUX.1-dev's transformer, as its diffusers config (out_channels None means in_channels).
FLUX_DEV_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
CONFIG_KEYS = tuple(FLUX_DEV_CONFIG)

# The FLUX architecture scaled to 80.1 B parameters (160 GB in bf16, more than one H200 holds): hidden 8192
# (64 heads of 128), 18 double and 36 single blocks. For serving a model that does not fit one GPU.
FLUX_80B_CONFIG = {**FLUX_DEV_CONFIG, "num_attention_heads": 64, "num_layers": 18, "num_single_layers": 36}

# A FLUX of ~0.5 M parameters for tests: the same structure at tiny sizes.
TINY_CONFIG = {
    "patch_size": 1,
    "in_channels": 8,
    "out_channels": None,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}


@dataclass(frozen=True)
class JointSlice:
    """This context-parallel rank's tokens of the joint [text; image] sequence.

    The sequence is padded at its end to a multiple of cp_size; the rank holds positions
    [start, start + local_len): its text tokens first, then its image tokens, then padding.
    """

    text_len: int
    image_len: int
    start: int
    local_len: int

    @classmethod
    def of(cls, text_len: int, image_len: int, comm: Communicator) -> "JointSlice":
        local_len = -(-(text_len + image_len) // comm.cp_size)
        return cls(text_len, image_len, comm.cp_rank * local_len, local_len)

    @property
    def valid_len(self) -> int:
        """Real (unpadded) tokens in the whole joint sequence."""
        return self.text_len + self.image_len

    def text_range(self) -> tuple[int, int]:
        """This rank's text tokens, as [first, end) text positions."""
        return min(self.start, self.text_len), min(self.start + self.local_len, self.text_len)

    def image_range(self) -> tuple[int, int]:
        """This rank's image tokens, as [first, end) image positions."""
        first, end = self.start - self.text_len, self.start + self.local_len - self.text_len
        return min(max(first, 0), self.image_len), min(max(end, 0), self.image_len)

    def padding(self) -> int:
        """Padding tokens this rank holds after its real ones."""
        return max(self.start + self.local_len - max(self.start, self.valid_len), 0)


class Flux(nn.Module):
    """One rank's FLUX.1 transformer: inputs by diffusers' names, output {"sample"} in full on every rank.

    fp8: the blocks' linear layers hold e4m3 weights with row scales (mdtriton.engine.fp8); the embedders,
    modulations and norms stay in the engine's data type.
    """

    def __init__(self, config: dict, comm: Communicator, fp8: bool = False):
        super().__init__()
        check_plan(config, comm.plan)
        self.comm = comm
        self.axes_dims = list(config["axes_dims_rope"])
        self.guidance_embeds = bool(config["guidance_embeds"])
        heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
        dim = heads * head_dim
        out_channels = config["out_channels"] or config["in_channels"]
        attention, packed_attention = attention_for(comm.plan), packed_attention_for(comm.plan)

        self.time_text_embed = TimeTextEmbedding(dim, config["pooled_projection_dim"], self.guidance_embeds)
        self.context_embedder = nn.Linear(config["joint_attention_dim"], dim)
        self.x_embedder = nn.Linear(config["in_channels"], dim)
        self.transformer_blocks = nn.ModuleList(
            FluxTransformerBlock(dim, heads, head_dim, comm, attention, packed_attention, fp8)
            for _ in range(config["num_layers"]))
        self.single_transformer_blocks = nn.ModuleList(
            FluxSingleTransformerBlock(dim, heads, head_dim, comm, attention, packed_attention, fp8)
            for _ in range(config["num_single_layers"]))
        self.norm_out = AdaLayerNormContinuous(dim)
        self.proj_out = nn.Linear(dim, config["patch_size"] ** 2 * out_channels)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor, guidance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Denoiser output for the image tokens: {"sample": [B, S_img, patch_size**2 * out_channels]}.

        Every rank gets the same full inputs and embeds only its own slice of the joint sequence.
        """
        tokens = JointSlice.of(encoder_hidden_states.shape[1], hidden_states.shape[1], self.comm)
        image, text, temb, cos, sin = self.embed(tokens, hidden_states, encoder_hidden_states, pooled_projections,
                                                 timestep, img_ids, txt_ids, guidance)
        modulations = self.modulations(temb, self.transformer_blocks, self.single_transformer_blocks)
        for block, modulation in zip(self.transformer_blocks, modulations):
            image, text = block(image, text, temb, (cos, sin), tokens.valid_len, modulation)
        joint = torch.cat((text, image), dim=1)
        del image, text
        for block, modulation in zip(self.single_transformer_blocks, modulations[len(self.transformer_blocks):]):
            joint = block(joint, temb, (cos, sin), tokens.valid_len, modulation)
        return self.finish_tokens(tokens, joint, temb)

    # First Block Cache (mdtriton.engine.step_cache) runs the forward in three parts, each taking the request's inputs
    # by name and what the parts before it returned.
    def first_block(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                    txt_ids: torch.Tensor, guidance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The embeddings and the first double block: its output, as the image and text streams and as the joint
        `hidden` [text; image] that the last block's output is compared with, and the `residual` of its image stream
        (output minus input, this rank's image tokens), which decides whether the other blocks run."""
        tokens = JointSlice.of(encoder_hidden_states.shape[1], hidden_states.shape[1], self.comm)
        image_in, text, temb, cos, sin = self.embed(tokens, hidden_states, encoder_hidden_states, pooled_projections,
                                                    timestep, img_ids, txt_ids, guidance)
        first_block = self.transformer_blocks[0]
        modulation, = self.modulations(temb, [first_block])
        image, text = first_block(image_in, text, temb, (cos, sin), tokens.valid_len, modulation)
        first, end = tokens.image_range()
        return {"image": image, "text": text, "temb": temb, "cos": cos, "sin": sin,
                "hidden": torch.cat((text, image), dim=1), "residual": (image - image_in)[:, :end - first]}

    def other_blocks(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                     **_) -> dict[str, torch.Tensor]:
        """Every block after the first, then the output: forward's outputs, and "hidden", the last block's output
        (joint [text; image])."""
        tokens = JointSlice.of(encoder_hidden_states.shape[1], hidden_states.shape[1], self.comm)
        double_blocks = self.transformer_blocks[1:]
        modulations = self.modulations(temb, double_blocks, self.single_transformer_blocks)
        for block, modulation in zip(double_blocks, modulations):
            image, text = block(image, text, temb, (cos, sin), tokens.valid_len, modulation)
        joint = torch.cat((text, image), dim=1)
        for block, modulation in zip(self.single_transformer_blocks, modulations[len(double_blocks):]):
            joint = block(joint, temb, (cos, sin), tokens.valid_len, modulation)
        return {**self.finish_tokens(tokens, joint, temb), "hidden": joint}

    def finish(self, hidden: torch.Tensor, temb: torch.Tensor, hidden_states: torch.Tensor,
               encoder_hidden_states: torch.Tensor, **_) -> dict[str, torch.Tensor]:
        """The output of the last block's output `hidden` (a step that skips the other blocks)."""
        tokens = JointSlice.of(encoder_hidden_states.shape[1], hidden_states.shape[1], self.comm)
        return self.finish_tokens(tokens, hidden, temb)

    # TaylorSeer (mdtriton.engine.step_cache) runs the forward keeping every attention's outputs, or with them given:
    # "attention.<i>" in the blocks' order, two per double block (image, text), one per single block.
    def keep_attention(self, **inputs) -> dict[str, torch.Tensor]:
        """forward's outputs, and each attention's outputs."""
        return self.with_attention(inputs, None)

    def given_attention(self, **tensors) -> dict[str, torch.Tensor]:
        """forward's outputs, each attention's outputs taken from the tensors instead of computed."""
        given = [tensors.pop(f"attention.{i}") for i in range(2 * len(self.transformer_blocks)
                                                              + len(self.single_transformer_blocks))]
        return self.with_attention(tensors, given)

    def with_attention(self, inputs: dict[str, torch.Tensor],
                       given: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        tokens = JointSlice.of(inputs["encoder_hidden_states"].shape[1], inputs["hidden_states"].shape[1], self.comm)
        image, text, temb, cos, sin = self.embed(tokens, **inputs)
        modulations = self.modulations(temb, self.transformer_blocks, self.single_transformer_blocks)
        kept = []
        for index, block in enumerate(self.transformer_blocks):
            modulation = modulations[index]
            if given is None:
                image, text, attention = block(image, text, temb, (cos, sin), tokens.valid_len, modulation,
                                               keep_attention=True)
                kept += attention
            else:
                attention = (given[2 * index], given[2 * index + 1])
                image, text = block(image, text, temb, (cos, sin), tokens.valid_len, modulation, attention=attention)
        joint = torch.cat((text, image), dim=1)
        del image, text
        offset = 2 * len(self.transformer_blocks)
        for index, block in enumerate(self.single_transformer_blocks):
            modulation = modulations[len(self.transformer_blocks) + index]
            if given is None:
                joint, attention = block(joint, temb, (cos, sin), tokens.valid_len, modulation, keep_attention=True)
                kept.append(attention)
            else:
                joint = block(joint, temb, (cos, sin), tokens.valid_len, modulation, attention=given[offset + index])
        return {**self.finish_tokens(tokens, joint, temb), **{f"attention.{i}": t for i, t in enumerate(kept)}}

    def embed(self, tokens: JointSlice, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
              pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor,
              guidance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """This rank's image and text tokens embedded (image padded), the conditioning temb, and the rotary cos and
        sin of its tokens."""
        if self.guidance_embeds and guidance is None:
            raise ValueError("this FLUX config has guidance_embeds; pass a guidance input [B]")
        text_first, text_end = tokens.text_range()
        image_first, image_end = tokens.image_range()
        padding = tokens.padding()
        # Contiguous slices, so the embedders' GEMMs fuse their bias as on one rank.
        text = self.context_embedder(encoder_hidden_states[:, text_first:text_end].contiguous())
        image = self.x_embedder(hidden_states[:, image_first:image_end].contiguous())
        ids = torch.cat((txt_ids[text_first:text_end], img_ids[image_first:image_end]))
        if padding:
            image = F.pad(image, (0, 0, 0, padding))
            ids = F.pad(ids, (0, 0, 0, padding))
        cos, sin = rotary_embedding(ids, self.axes_dims)
        timestep = timestep.to(image.dtype) * 1000
        if self.guidance_embeds:
            guidance = guidance.to(image.dtype) * 1000
        return image, text, self.time_text_embed(timestep, guidance, pooled_projections), cos, sin

    def modulations(self, temb: torch.Tensor, *blocks: Iterable[nn.Module]) -> list[Modulation]:
        """The modulation of each block of blocks (those of each iterable, in order), computed for all of them at
        once, split across the context-parallel ranks (layers.modulation_shares). On one context-parallel rank there
        is nothing to split: None for each, and each block computes its own in its compiled code."""
        blocks = [block for group in blocks for block in group]
        if self.comm.cp_size == 1:
            return [None] * len(blocks)
        shares = iter(modulation_shares(temb, [linear for block in blocks for linear in block.modulation_linears()],
                                        self.comm))
        return [tuple(next(shares) for _ in block.modulation_linears()) for block in blocks]

    def finish_tokens(self, tokens: JointSlice, joint: torch.Tensor, temb: torch.Tensor) -> dict[str, torch.Tensor]:
        # The final norm and projection are per token; doing them on the text tokens too costs little and
        # lets every rank contribute an equal slice to the gather.
        sample = self.comm.cp_all_gather(self.proj_out(self.norm_out(joint, temb)), dim=1)
        return {"sample": sample[:, tokens.text_len:tokens.valid_len].contiguous()}

    def fuse_projections(self) -> None:
        """Arrange the blocks' projections for speed (flux_blocks: q/k/v joined, the single blocks' output
        projection split by its inputs); call once the weights are loaded."""
        for block in (*self.transformer_blocks, *self.single_transformer_blocks):
            block.fuse_projections()

    def compiled_regions(self) -> list[nn.Module]:
        """The modules to compile: every block (two kinds, so two compiled codes serve all 57 of FLUX.1-dev).
        Attention and collectives inside them run eagerly (graph breaks), the regions between them compiled."""
        return [*self.transformer_blocks, *self.single_transformer_blocks]


def example_inputs(config: dict, text_tokens: int, image_tokens: int, dtype: torch.dtype,
                batch: int = 1, columns: int | None = None) -> dict[str, torch.Tensor]:
    """One request's inputs (CPU, seeded): random latents and text, image ids on a grid `columns` patches wide (by
    default a square-ish one).

    Timestep 0.5 and guidance 4.0 scale (x 1000) to values bf16 holds exactly, so a float32 forward of the
    same inputs sees the same conditioning (3.5 would become 3504 in bf16 and 3500 in float32)."""
    generator = torch.Generator().manual_seed(0)
    side = columns or math.isqrt(image_tokens)
    positions = torch.arange(image_tokens)
    inputs = {
        "hidden_states": torch.randn(batch, image_tokens, config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(batch, text_tokens, config["joint_attention_dim"], generator=generator),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=generator),
        "timestep": torch.full((batch,), 0.5),
    }
    if config["guidance_embeds"]:
        inputs["guidance"] = torch.full((batch,), 4.0)
    inputs = {name: tensor.to(dtype) for name, tensor in inputs.items()}
    inputs["img_ids"] = torch.stack((torch.zeros(image_tokens), positions // side, positions % side), dim=1).float()
    inputs["txt_ids"] = torch.zeros(text_tokens, 3)
    return inputs


def check_plan(config: dict, plan: ParallelPlan) -> None:
    """Raise ValueError saying what to change if config is not a FLUX config or plan cannot split it."""
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"FLUX config lacks {', '.join(missing)} "
                         "(its keys are those of diffusers' FluxTransformer2DModel config)")
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    axes_dims = list(config["axes_dims_rope"])
    if sum(axes_dims) != head_dim or any(d % 2 for d in axes_dims):
        raise ValueError(f"axes_dims_rope {axes_dims} must be even sizes adding up to "
                         f"attention_head_dim {head_dim}")
    plan.check_heads(heads)
