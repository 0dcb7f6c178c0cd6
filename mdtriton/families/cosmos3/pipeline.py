"""The Cosmos 3 pipeline served as one model ("cosmos3-pipeline"): diffusers' Cosmos3OmniPipeline, text to video,
text to image (num_frames 1) and image to video (the `image` input).

Inputs are named after `Cosmos3OmniPipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows:
mdtriton.pipeline.prompts; the conditioning image UINT8 [height, width, 3]); the output is the video as UINT8 [1,
frames, height, width, 3] (one video per request, as the pipeline makes them); progress responses carry `step` only.
diffusers runs the pipeline (the chat template and metadata sentences, the initial noise from a CPU generator seeded
with `seed`, the UniPC loop with classifier-free guidance, the Wan 2.2 VAE), so a video equals diffusers' for the same
components; its transformer is our engine, which runs the text pathway once per request (`EngineTransformer`).
Sound, action-conditioned and video-to-video generation are refused, naming what is served. diffusers' safety checker
(`cosmos_guardrail`) runs where that package is installed, and is off otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families.family import PipelinePart, Signature
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (check_frames, check_image, check_sides, check_steps_and_guidance,
                                             loras_of, prompts_of)
from mdtriton.pipeline.transformer import EngineAsTransformer

SERVED = "text to video, text to image (num_frames 1) and image to video (the image input)"
# Inputs of diffusers' call for what is not served, declared so that a request for them is refused saying so.
REFUSED = {"enable_sound": "sound generation", "conditioning_video": "video-to-video generation",
           "action": "action-conditioned generation"}
# A bound on the tokens of the chat template, the system prompt and the metadata sentences around a prompt (about
# 220 bytes of text; Cosmos 3's byte-level tokenizer makes at most one token per byte).
TEMPLATE_TOKENS = 256


class EngineTransformer(EngineAsTransformer):
    """Cosmos3OmniPipeline's `transformer`: a transformer engine called as Cosmos3OmniTransformer is (its packed
    [text; vision] sequence of one video, diffusers' layout: the text first, then the video's tokens).

    The text pathway runs once per text of a request: its keys and values (Cosmos3.text_keys_values) are kept for
    the request's conditional and unconditional texts and handed to every step's engine call.

    Guidance parallelism (cfg_size 2): the pipeline masks the conditional call's output before it makes the
    unconditional call, so the output must be there when the conditional call returns. The unconditional call's
    inputs differ from the conditional one's only by its text (and the positions after it), the same at every step;
    so the first step runs both calls on both guidance groups and keeps the unconditional call's text, and each
    later conditional call runs the conditional inputs on guidance group 0 and the unconditional ones (that text,
    this step's latents) on group 1 at once, exchanges the outputs (one all-gather) and keeps the unconditional one
    for the unconditional call, which returns it if its inputs are those (else it runs them)."""

    def __init__(self, engine: TorchEngine, pipeline: Any):
        super().__init__(engine)
        self.pipeline = pipeline
        # What the pipeline reads of its transformer's config; sound and action are not served.
        self.config = SimpleNamespace(**engine.manifest.config, sound_gen=False, action_gen=False, sound_dim=None,
                                      action_dim=None)
        self.branch = "cond"
        self.texts: dict[bytes, torch.Tensor] = {}  # this request's texts' keys and values, by their ids
        self.unconditional: dict[str, torch.Tensor] | None = None  # this request's unconditional call's text
        self.pending: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None

    def cache_context(self, name: str, **step):
        """The pipeline names each call's branch ("cond", "uncond") and step; step 0's conditional call starts a
        request."""
        if name == "cond" and step.get("step_index") == 0:
            self.texts, self.unconditional, self.pending = {}, None, None
        self.branch = name
        return super().cache_context(name)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, vision_tokens: list[torch.Tensor],
                vision_timesteps: torch.Tensor, vision_noisy_frame_indexes: list[torch.Tensor],
                **layout) -> tuple[list[torch.Tensor], None, None]:
        """The velocity of the video, as diffusers' model returns it with return_dict=False (as the pipeline calls it):
        ([sample [1, C, T, H, W]], no sound, no actions). The layout's indexes are diffusers' (text first)."""
        others = [name for name, value in layout.items() if name.startswith(("sound_", "action_")) and value is not None]
        if others or len(vision_tokens) != 1:
            raise ValueError(f"Cosmos 3 is served for one video and no sound or actions; this call has {others} and "
                             f"{len(vision_tokens)} videos")
        latent = vision_tokens[0]
        noisy = torch.zeros(latent.shape[2], device=latent.device)
        noisy[vision_noisy_frame_indexes[0]] = 1.0
        # Every noisy token has the step's timestep in the pipeline; the engine takes it once.
        if vision_timesteps.numel() and not bool((vision_timesteps == vision_timesteps[0]).all()):
            raise ValueError("a timestep per token that differs within the video is not served")
        inputs = {"position_ids": position_ids.float(), "vision_tokens": latent.to(self._dtype),
                  "timestep": vision_timesteps[:1].float() if vision_timesteps.numel() else noisy.new_zeros(1),
                  "noisy_frames": noisy, "text_keys_values": self.text_keys_values(input_ids, position_ids)}
        return [self.branch_output(inputs)], None, None

    def text_keys_values(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The keys and values of a text of this request, made at its first call."""
        text_positions = position_ids[:, :input_ids.shape[0]].float()
        key = input_ids.cpu().numpy().tobytes() + text_positions.cpu().numpy().tobytes()
        if key not in self.texts:
            self.before_collectives()  # the text pathway's tensor-parallel layers all-reduce
            with torch.inference_mode():
                self.texts[key] = self.engine.module.text_keys_values(input_ids.to(self.device),
                                                                      text_positions.to(self.device))
        return self.texts[key]

    def branch_output(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """This call's output; under guidance parallelism both branches' at a conditional call (class docstring)."""
        comm = self.engine.comm
        if comm.cfg_size == 1 or not self.pipeline.do_classifier_free_guidance:
            return self.run_engine(inputs)
        if self.branch == "cond":
            if self.unconditional is None:  # the first step: the unconditional text is not known yet
                return self.run_engine(inputs)
            unconditional = {**self.unconditional, "vision_tokens": inputs["vision_tokens"],
                             "timestep": inputs["timestep"]}
            # Each guidance group runs one branch, in that branch's step cache context.
            super().cache_context("cond" if comm.cfg_rank == 0 else "uncond")
            both = comm.cfg_all_gather(self.run_engine(inputs if comm.cfg_rank == 0 else unconditional))
            self.pending = (unconditional, both[1])
            return both[0]
        pending, self.pending = self.pending, None
        if pending is not None and same_inputs(pending[0], inputs):
            return pending[1]
        self.unconditional = {name: inputs[name] for name in ("position_ids", "noisy_frames", "text_keys_values")}
        return self.run_engine(inputs)


def same_inputs(kept: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> bool:
    """Whether an engine call's inputs are those kept (the text's keys and values: the same tensor, kept per text)."""
    return kept["text_keys_values"] is given["text_keys_values"] and all(
        torch.equal(kept[name], given[name]) for name in ("position_ids", "noisy_frames", "vision_tokens", "timestep"))


class Cosmos3PipelinePart(PipelinePart):
    diffusers_class = "Cosmos3OmniPipeline"
    guidance_branches = True
    request_timeout_s = 3600.0  # a 35-step 720p clip of 189 frames, with guidance, on one GPU
    # diffusers' First Block Cache knows Cosmos 3's decoder layer (its vision tokens are the hidden states); its
    # TaylorSeer's default patterns match no Cosmos 3 module, as for Wan.
    cache_methods = ("first_block",)

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            TensorSpec("negative_prompt", "STRING", (-1,)),
            TensorSpec("image", "UINT8", (-1, -1, 3)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_frames", "INT32", (1,)),
            TensorSpec("fps", "FP32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("guidance_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
            TensorSpec("enable_sound", "INT32", (1,)),
            TensorSpec("conditioning_video", "UINT8", (-1, -1, -1, 3)),
            TensorSpec("action", "STRING", (1,)),
        )
        outputs = (TensorSpec("video", "UINT8", (-1, -1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"negative_prompt": None, "image": None, "height": 720, "width": 1280, "num_frames": 189, "fps": 24.0,
                "num_inference_steps": 35, "guidance_scale": 6.0, "seed": 0, "enable_sound": None,
                "conditioning_video": None, "action": None}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The VAE's compression (Cosmos3OmniPipeline's vae_scale_factor_temporal and _spatial)."""
        vae_config = json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())
        return {"vae_scale_factor_temporal": vae_config.get("scale_factor_temporal", 4),
                "vae_scale_factor_spatial": vae_config.get("scale_factor_spatial", 16)}

    def load_arguments(self, pipeline_dir: Path) -> dict:
        """diffusers' safety checker only where `cosmos_guardrail` is installed (it makes one by default, and fails
        without the package)."""
        from diffusers.utils import is_cosmos_guardrail_available

        return {} if is_cosmos_guardrail_available() else {"enable_safety_checker": False, "safety_checker": None}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """One prompt (and at most one negative prompt), UTF-8; no request for what is not served (REFUSED) nor LoRA
        adapters; a frame count the VAE takes (4k+1), sides that are multiples of its compression, more tokens than the
        engine takes (naming what fits), an image only for a video and of a bounded size and aspect, step counts,
        guidance in range, a positive fps."""
        prompts = prompts_of(inputs, "prompt")
        negative = prompts_of(inputs, "negative_prompt") if "negative_prompt" in inputs else []
        if len(prompts) != 1 or len(negative) > 1:
            raise RequestError(f"Cosmos 3's pipeline makes one video per request: send one prompt and at most one "
                               f"negative_prompt (this request has {len(prompts)} and {len(negative)})")
        for name, what in REFUSED.items():
            if name in inputs and (name != "enable_sound" or int(inputs[name][0])):
                raise RequestError(f"{what} is not served ({name}); this model serves {SERVED}: leave {name} out")
        if loras_of(inputs):
            raise RequestError("Cosmos 3's pipeline takes no LoRA adapters (diffusers' Cosmos3OmniPipeline has no LoRA "
                               "loader): leave loras out")
        config = manifest.config
        spatial = config["vae_scale_factor_spatial"]
        frames = check_frames(inputs, config["vae_scale_factor_temporal"], "1 makes an image; Cosmos 3's clips: 189")
        height, width = check_sides(inputs, spatial, f"the VAE's {spatial}x compression")
        video = video_tokens(manifest, frames, height, width)
        text = max(len(prompt.encode()) for prompt in prompts + negative) + TEMPLATE_TOKENS
        if video + text > manifest.limits.max_tokens:
            raise RequestError(f"{width}x{height} x {frames} frames is {video} video tokens, and the prompt up to {text} "
                               f"text tokens, over this engine's maximum of {manifest.limits.max_tokens}; send fewer "
                               "frames, a smaller size or a shorter prompt (the limit is set at build time: mdtriton "
                               "build --max-tokens)")
        if "image" in inputs:
            if frames == 1:
                raise RequestError("an image conditions a video's first frame; with num_frames 1 (an image) leave image "
                                   "out, or ask for a video (num_frames 4k+1 > 1)")
            check_image(inputs["image"], height, width)
        fps = float(inputs["fps"][0])
        if not math.isfinite(fps) or fps <= 0:
            raise RequestError(f"fps {fps} is not a positive number; send the clip's frame rate (Cosmos 3: 24)")
        check_steps_and_guidance(inputs, ("guidance_scale",), "Cosmos 3: 6.0")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        arguments = {
            "prompt": read_prompts(inputs["prompt"], "prompt")[0],
            "height": int(inputs["height"][0]),
            "width": int(inputs["width"][0]),
            "num_frames": int(inputs["num_frames"][0]),
            "fps": float(inputs["fps"][0]),
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
        }
        if "negative_prompt" in inputs:
            arguments["negative_prompt"] = read_prompts(inputs["negative_prompt"], "negative_prompt")[0]
        if "image" in inputs:
            arguments["image"] = inputs["image"].permute(2, 0, 1)  # the pipeline takes a tensor as [3, H, W]
        return arguments

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"video": UINT8 [1, frames, height, width, 3]} of Cosmos3OmniPipeline's video [frames, 3, H, W] in [0, 1],
        rounded as diffusers rounds images (in float32)."""
        video = (result.video.float().permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
        return {"video": video[None]}

    def transformer(self, engine: TorchEngine, pipeline: Any) -> torch.nn.Module:
        return EngineTransformer(engine, pipeline)


def video_tokens(manifest: Manifest, frames: int, height: int, width: int) -> int:
    """The transformer's video tokens: latent frames x rows x columns of patches (sides padded to whole patches)."""
    config = manifest.config
    patch, spatial = config["transformer"]["latent_patch_size"], config["vae_scale_factor_spatial"]
    latent_frames = (frames - 1) // config["vae_scale_factor_temporal"] + 1
    return latent_frames * -(-height // spatial // patch) * -(-width // spatial // patch)
