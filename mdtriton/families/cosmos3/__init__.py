"""Family "cosmos3": NVIDIA Cosmos 3 (diffusers' Cosmos3OmniTransformer), video and image generation,
tensor-parallel by heads (grouped-query: 8 key/value heads) and context-parallel by tokens of the joint [text; vision]
sequence, with FP8 weights on GPUs; and its whole pipeline ("cosmos3-pipeline", diffusers' Cosmos3OmniPipeline: text to
video, text to image, image to video)."""

from __future__ import annotations

import copy
import math

import torch

from mdtriton.engine.manifest import TensorSpec
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.cosmos3.pipeline import Cosmos3PipelinePart
from mdtriton.families.cosmos3.transformer import COSMOS3_CONFIG, TINY_CONFIG, Cosmos3, check_plan
from mdtriton.families.family import AttentionShape, Family, RequestSize, Signature

# The warm-up requests' (text tokens, latent frames, latent height and width), in order: a short one, then 480p x
# 189 frames, the size most requests have (graphs are tuned for the sizes they first see). Text lengths are prime and
# text plus video tokens odd, so that no size of the warm-up equals a model dimension or another of its sizes (Dynamo
# would take two equal sizes for one).
WARM_UP_SHAPES = ((127, 2, 14, 22), (509, 48, 30, 52))
TEXT_TOKENS = 256  # a typical request's text: the system prompt, the prompt and the metadata sentences
# The Wan 2.2 VAE's compression: 4 frames after the first into one latent frame (the positions follow it), 16x16 pixels
# into one latent.
VAE_TEMPORAL = 4
VAE_SPATIAL = 16


class Cosmos3Family(Family):
    name = "cosmos3"
    description = ("NVIDIA Cosmos 3 transformer (diffusers' Cosmos3OmniTransformer), video and image: tp, cp, "
                   "tp x cp; FP8 on GPUs")
    module_class = Cosmos3
    supports_fp8 = True
    pipeline = Cosmos3PipelinePart()
    max_tokens = 48_000  # 720p x 189 frames (44,160 video tokens) with up to 3,840 text tokens
    # Checkpoint weights the module does not hold: the language head and the text's final norm (the text's outputs are
    # never read, only its keys and values), and the sound and action heads (not served).
    unused_weights = ("lm_head.", "norm.", "audio_", "action_")

    def presets(self) -> dict[str, dict]:
        return {"tiny": copy.deepcopy(TINY_CONFIG), "cosmos3-15b": copy.deepcopy(COSMOS3_CONFIG)}

    def config_from_diffusers(self, config_json: dict) -> dict:
        """As the family's default, and rope_axes_dim from rope_scaling's mrope_section where a config.json gives no
        rope_axes_dim (as diffusers derives it)."""
        config = super().config_from_diffusers(config_json)
        if config_json.get("rope_axes_dim") is None:
            config["rope_axes_dim"] = (config_json.get("rope_scaling") or {}).get("mrope_section", [24, 20, 20])
        config["rope_axes_dim"] = list(config["rope_axes_dim"])
        return config

    def check_plan(self, config: dict, plan: ParallelPlan) -> None:
        check_plan(config, plan)

    def signature(self, config: dict, data_type: str) -> Signature:
        """One video (or image) per request, as diffusers' pipeline calls the transformer: the text's token ids [L],
        the joint sequence's 3D rotary positions [3, L + N] (FP32), the latent video [1, C, T, H, W], the timestep [1]
        (FP32, 0-1000) and which latent frames are noisy [T] (FP32, 1.0 or 0.0); the velocity like the latent."""
        latent = (1, config["latent_channel"], -1, -1, -1)
        inputs = (TensorSpec("input_ids", "INT64", (-1,)), TensorSpec("position_ids", "FP32", (3, -1)),
                  TensorSpec("vision_tokens", data_type, latent), TensorSpec("timestep", "FP32", (1,)),
                  TensorSpec("noisy_frames", "FP32", (-1,)))
        return inputs, (TensorSpec("sample", data_type, latent),)

    def request_size(self, config: dict, inputs: dict[str, torch.Tensor]) -> RequestSize:
        """Text plus video tokens; ValueError if the inputs disagree on them, or a token id is not in the vocabulary
        (the ids, a few hundred, are read). A pipeline hands the text's keys and values (text_keys_values) instead of
        its ids."""
        _, _, frames, height, width = inputs["vision_tokens"].shape
        p = config["latent_patch_size"]
        video = frames * -(-height // p) * -(-width // p)
        if "input_ids" in inputs:
            ids = inputs["input_ids"]
            text = ids.shape[0]
            if int(ids.min()) < 0 or int(ids.max()) >= config["vocab_size"]:
                raise ValueError(f"input_ids holds ids outside the vocabulary; send ids from 0 to "
                                 f"{config['vocab_size'] - 1}")
        else:
            text = inputs["text_keys_values"].shape[4]
        if inputs["noisy_frames"].shape[0] != frames:
            raise ValueError(f"noisy_frames has {inputs['noisy_frames'].shape[0]} values for {frames} latent frames; "
                             "send one per latent frame (1.0 to denoise it, 0.0 for a conditioning frame)")
        if inputs["position_ids"].shape[1] != text + video:
            raise ValueError(f"position_ids has {inputs['position_ids'].shape[1]} positions for {text} text and "
                             f"{video} video tokens ({frames} frames of {-(-height // p)} x {-(-width // p)} patches); "
                             "send one position (3 rows: time, height, width) per token")
        return RequestSize(1, text + video)

    def warm_up_sample(self, config: dict, plan: ParallelPlan) -> dict[str, list[int]]:
        """cp_size text tokens and cp_size video tokens (one frame, one patch high): every context-parallel rank gets
        real tokens."""
        p = config["latent_patch_size"]
        return {"input_ids": [plan.cp_size], "position_ids": [3, 2 * plan.cp_size],
                "vision_tokens": [1, config["latent_channel"], 1, p, p * plan.cp_size], "timestep": [1],
                "noisy_frames": [1]}

    def warm_up_requests(self, config: dict, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        return [self.inputs(config, text, latent, dtype) for text, *latent in WARM_UP_SHAPES]

    def example_request(self, config: dict, tokens: int, dtype: torch.dtype,
                        batch: int = 1) -> dict[str, torch.Tensor]:
        """A 16:9 video of about `tokens` tokens (256 of them text; frames first, up to 189: 48 latent frames, as many
        as a 720p frame's 920 tokens allow): 720p x 189 frames is 44,160 video tokens, 480p 18,720."""
        if batch != 1:
            raise ValueError("Cosmos 3's transformer takes one video per request")
        p = config["latent_patch_size"]
        video = max(1, tokens - TEXT_TOKENS)
        frames = max(1, min(48, round(video / 920)))
        per_frame = max(1, video // frames)
        rows = max(1, math.isqrt(per_frame * 9 // 16))
        return self.inputs(config, TEXT_TOKENS, (frames, rows * p, max(1, per_frame // rows) * p), dtype)

    def media_request(self, config: dict, frames: int, height: int, width: int,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Cosmos3OmniPipeline's: the latent video of frames x height x width pixels (4k+1 frames, 1 an image; sides
        multiples of 16, the VAE's compression), 256 text tokens, at 24 fps."""
        if frames < 1 or (frames - 1) % VAE_TEMPORAL:
            below = max(frames - 1, 0) // VAE_TEMPORAL * VAE_TEMPORAL + 1
            raise ValueError(f"{frames} frames is not 4k+1 (Cosmos 3's VAE compresses 4 frames after the first into "
                             f"one); ask for {below} or {below + VAE_TEMPORAL}")
        for name, side in (("height", height), ("width", width)):
            if side < VAE_SPATIAL or side % VAE_SPATIAL:
                raise ValueError(f"{name} {side} is not a positive multiple of {VAE_SPATIAL} (the VAE's compression); "
                                 f"send a multiple of {VAE_SPATIAL}")
        latent = ((frames - 1) // VAE_TEMPORAL + 1, height // VAE_SPATIAL, width // VAE_SPATIAL)
        return self.inputs(config, TEXT_TOKENS, latent, dtype)

    def attention_shape(self, config: dict) -> AttentionShape:
        return AttentionShape(config["num_hidden_layers"], config["num_attention_heads"],
                              config["num_key_value_heads"], config["head_dim"])

    @staticmethod
    def inputs(config: dict, text_tokens: int, latent: tuple[int, int, int], dtype: torch.dtype,
               fps: float = 24.0) -> dict[str, torch.Tensor]:
        """A seeded request (CPU) of text_tokens random ids and a random latent video of latent (frames, height,
        width; sides padded to whole patches as diffusers pads them), timestep 500, every frame noisy, positions as
        the pipeline makes them at fps."""
        generator = torch.Generator().manual_seed(0)
        frames, height, width = latent
        p = config["latent_patch_size"]
        return {
            "input_ids": torch.randint(0, config["vocab_size"], (text_tokens,), generator=generator),
            "position_ids": position_ids(config, text_tokens, (frames, -(-height // p), -(-width // p)), fps),
            "vision_tokens": torch.randn(1, config["latent_channel"], *latent, generator=generator).to(dtype),
            "timestep": torch.tensor([500.0]),
            "noisy_frames": torch.ones(frames),
        }


def position_ids(config: dict, text_tokens: int, grid: tuple[int, int, int], fps: float) -> torch.Tensor:
    """The joint sequence's positions [3, text + video tokens] as diffusers' Cosmos3OmniPipeline makes them (float32):
    text at 0, 1, ... on all three axes; the video's frames from text_tokens + the modality margin, in steps scaled by
    fps against base_fps when the config modulates by fps and there is more than one frame, its rows and columns from
    0."""
    frames, rows, columns = grid
    text = torch.arange(text_tokens, dtype=torch.float32).expand(3, -1)
    offset = text_tokens + config["unified_3d_mrope_temporal_modality_margin"]
    steps = torch.arange(frames, dtype=torch.float32)
    if config["enable_fps_modulation"] and frames > 1:
        steps = steps / (fps / VAE_TEMPORAL) * (config["base_fps"] / VAE_TEMPORAL)
    time = (steps + offset).repeat_interleave(rows * columns)
    height = torch.arange(rows).repeat_interleave(columns).repeat(frames).float()
    width = torch.arange(columns).repeat(frames * rows).float()
    if not config["unified_3d_mrope_reset_spatial_ids"]:
        height, width = height + offset, width + offset
    return torch.cat((text, torch.stack((time, height, width))), dim=1)


COSMOS3 = Cosmos3Family()
