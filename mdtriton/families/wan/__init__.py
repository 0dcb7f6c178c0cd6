"""Family "wan": Wan 2.x (diffusers' WanTransformer3DModel: Wan 2.1 T2V 1.3B and 14B, Wan 2.1 I2V 14B, Wan 2.2 T2V
and I2V A14B's experts, Wan 2.2 TI2V 5B), tensor-parallel by heads and context-parallel by the video's tokens, with
FP8 weights on GPUs; and its whole pipelines: "wan-pipeline" (diffusers' WanPipeline: prompt to video) and
"wan-i2v-pipeline" (diffusers' WanImageToVideoPipeline: an image and a prompt to video)."""

from __future__ import annotations

import copy
import math

import torch

from mdtriton.engine.manifest import TensorSpec
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.family import Family, RequestSize, Signature
from mdtriton.families.wan.image_pipeline import WanImageToVideoPipelinePart
from mdtriton.families.wan.pipeline import WanPipelinePart
from mdtriton.families.wan.transformer import (TINY_CONFIG, WAN_1_3B_CONFIG, WAN_5B_CONFIG, WAN_14B_CONFIG,
                                               WAN_I2V_14B_CONFIG, Wan, check_plan)

# The warm-up requests' (batch, patches along frames, height and width, text tokens), in order: batch 7 first,
# whose graphs serve every batch of 2 or more, then batch 1 (a size-1 dimension is always specialised) at 480p x 81
# frames, the size most requests have (graphs are tuned for the sizes they first see). Text lengths are prime so that
# no size of the warm-up equals a model dimension (Dynamo would take two equal sizes for one).
WARM_UP_SHAPES = ((7, 3, 7, 11, 127), (1, 21, 30, 52, 509))
TEXT_TOKENS = 512  # WanPipeline's max_sequence_length
IMAGE_TOKENS = 257  # Wan 2.1 I2V's image encoder (CLIP ViT-H/14 at 224 px: 16 x 16 patches and its class token)
# The VAE's compression: 4 frames after the first into one latent frame; 8x8 pixels into one latent (Wan 2.1's VAE,
# 16 latent channels, and the tests' tiny one), 16x16 for Wan 2.2's VAE (48 latent channels, TI2V 5B).
VAE_TEMPORAL = 4
WAN_2_2_VAE_CHANNELS = 48


class WanFamily(Family):
    name = "wan"
    description = ("Wan 2.x text- and image-to-video transformer (diffusers' WanTransformer3DModel): tp, cp, tp x cp; "
                   "FP8 on GPUs")
    module_class = Wan
    supports_fp8 = True
    pipeline = WanPipelinePart()
    more_pipelines = {"wan-i2v-pipeline": WanImageToVideoPipelinePart()}
    max_tokens = 75_600  # 720p x 81 frames

    def presets(self) -> dict[str, dict]:
        return {"tiny": copy.deepcopy(TINY_CONFIG), "wan2.1-t2v-1.3b": copy.deepcopy(WAN_1_3B_CONFIG),
                "wan2.1-t2v-14b": copy.deepcopy(WAN_14B_CONFIG), "wan2.2-ti2v-5b": copy.deepcopy(WAN_5B_CONFIG),
                "wan2.1-i2v-14b": copy.deepcopy(WAN_I2V_14B_CONFIG)}

    def config_from_diffusers(self, config_json: dict) -> dict:
        config = super().config_from_diffusers(config_json)
        config["patch_size"] = list(config["patch_size"])
        return config

    def check_plan(self, config: dict, plan: ParallelPlan) -> None:
        check_plan(config, plan)

    def signature(self, config: dict, data_type: str) -> Signature:
        """As diffusers' forward: the latent video [B, C, F, H, W], the timestep [B] (FP32: the time embedding is
        computed in float32), the text embeddings [B, L, text_dim], and for a model with an image encoder (Wan 2.1
        I2V) the image's tokens [B, I, image_dim]; the sample like the latent."""
        out_channels = config["out_channels"] or config["in_channels"]
        inputs = (TensorSpec("hidden_states", data_type, (-1, config["in_channels"], -1, -1, -1)),
                  TensorSpec("timestep", "FP32", (-1,)),
                  TensorSpec("encoder_hidden_states", data_type, (-1, -1, config["text_dim"])))
        if config["image_dim"] is not None:
            inputs += (TensorSpec("encoder_hidden_states_image", data_type, (-1, -1, config["image_dim"])),)
        return inputs, (TensorSpec("sample", data_type, (-1, out_channels, -1, -1, -1)),)

    def request_size(self, config: dict, inputs: dict[str, torch.Tensor]) -> RequestSize:
        """The video's tokens (its patches); ValueError if the sizes do not divide into patches, exceed the rotary
        table, disagree on the batch, or a timestep per token (in-process pipelines: Wan 2.2 TI2V given an image) has
        another count of tokens, or an image-to-video model lacks its image's tokens."""
        batch, _, *sizes = inputs["hidden_states"].shape
        if config["image_dim"] is not None and "encoder_hidden_states_image" not in inputs:
            raise ValueError("this Wan is an image-to-video one: send the image encoder's tokens as "
                             "encoder_hidden_states_image")
        for name in ("timestep", "encoder_hidden_states", "encoder_hidden_states_image"):
            if name in inputs and inputs[name].shape[0] != batch:
                raise ValueError(f"{name} has batch size {inputs[name].shape[0]} but hidden_states has {batch}; "
                                 "every per-sample input needs the same batch size")
        grid = []
        for axis, size, patch in zip(("frames", "height", "width"), sizes, config["patch_size"]):
            if size % patch:
                raise ValueError(f"hidden_states has {size} latent {axis}, not a multiple of the patch size {patch}; "
                                 f"send a multiple of {patch}")
            if size // patch > config["rope_max_seq_len"]:
                raise ValueError(f"hidden_states has {size // patch} patches of {axis}, over the "
                                 f"{config['rope_max_seq_len']} the rotary embedding covers; send a smaller video")
            grid.append(size // patch)
        tokens = math.prod(grid)
        if inputs["timestep"].ndim == 2 and inputs["timestep"].shape[1] != tokens:
            raise ValueError(f"timestep has {inputs['timestep'].shape[1]} timesteps per sample but the video "
                             f"{tokens} tokens; send one per sample or one per token")
        return RequestSize(batch, tokens)

    def warm_up_sample(self, config: dict, plan: ParallelPlan) -> dict[str, list[int]]:
        """One frame of patches, cp_size patches wide (one per context-parallel rank), and cp_size text tokens."""
        p_t, p_h, p_w = config["patch_size"]
        sample = {"hidden_states": [1, config["in_channels"], p_t, p_h, p_w * plan.cp_size], "timestep": [1],
                  "encoder_hidden_states": [1, plan.cp_size, config["text_dim"]]}
        if config["image_dim"] is not None:
            sample["encoder_hidden_states_image"] = [1, image_tokens(config), config["image_dim"]]
        return sample

    def warm_up_requests(self, config: dict, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        p_t, p_h, p_w = config["patch_size"]
        return [self.inputs(config, (frames * p_t, height * p_h, width * p_w), text, dtype, batch)
                for batch, frames, height, width, text in WARM_UP_SHAPES]

    def example_request(self, config: dict, tokens: int, dtype: torch.dtype,
                        batch: int = 1) -> dict[str, torch.Tensor]:
        """A 16:9-ish video of about `tokens` patches (frames first, as many as a 480p frame's tokens allow) with 512
        text tokens: 81 frames at 480p is 32,760 tokens, at 720p 75,600."""
        p_t, p_h, p_w = config["patch_size"]
        frames = max(1, min(21, round(tokens / 1560)))
        per_frame = max(1, tokens // frames)
        height = max(1, math.isqrt(per_frame * 9 // 16))
        width = max(1, per_frame // height)
        return self.inputs(config, (frames * p_t, height * p_h, width * p_w), TEXT_TOKENS, dtype, batch)

    def media_request(self, config: dict, frames: int, height: int, width: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """WanPipeline's: the latent video of frames x height x width pixels (4k+1 frames; sides multiples of the
        VAE's compression times the patch), 512 text tokens."""
        spatial = 16 if config["in_channels"] == WAN_2_2_VAE_CHANNELS else 8
        if frames < 1 or (frames - 1) % VAE_TEMPORAL:
            below = max(frames - 1, 0) // VAE_TEMPORAL * VAE_TEMPORAL + 1
            raise ValueError(f"{frames} frames is not 4k+1 (Wan's VAE compresses 4 frames after the first into one); "
                             f"ask for {below} or {below + VAE_TEMPORAL}")
        multiple = spatial * config["patch_size"][1]
        for name, side in (("height", height), ("width", width)):
            if side < multiple or side % multiple:
                raise ValueError(f"{name} {side} is not a positive multiple of {multiple} (the VAE's {spatial}x "
                                 f"compression times the patch); send a multiple of {multiple}")
        latent = ((frames - 1) // VAE_TEMPORAL + 1, height // spatial, width // spatial)
        return self.inputs(config, latent, TEXT_TOKENS, dtype)

    @staticmethod
    def inputs(config: dict, latent_size: tuple[int, int, int], text_tokens: int, dtype: torch.dtype,
               batch: int = 1) -> dict[str, torch.Tensor]:
        """A seeded request (CPU): a random latent video of latent_size (frames, height, width), timestep 500."""
        generator = torch.Generator().manual_seed(0)
        inputs = {
            "hidden_states": torch.randn(batch, config["in_channels"], *latent_size, generator=generator).to(dtype),
            "timestep": torch.full((batch,), 500.0),
            "encoder_hidden_states": torch.randn(batch, text_tokens, config["text_dim"], generator=generator).to(dtype),
        }
        if config["image_dim"] is not None:
            inputs["encoder_hidden_states_image"] = torch.randn(batch, image_tokens(config), config["image_dim"],
                                                                generator=generator).to(dtype)
        return inputs


def image_tokens(config: dict) -> int:
    """The image encoder's tokens an image-to-video model takes: 257 per image (both images' with pos_embed_seq_len,
    Wan 2.1 FLF2V)."""
    return config["pos_embed_seq_len"] or IMAGE_TOKENS


WAN = WanFamily()
