"""The Wan pipeline served as one model ("wan-pipeline"): diffusers' WanPipeline, prompt to video.

Inputs are named after `WanPipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows: mdtriton.pipeline.prompts), the output is the
video as UINT8 [batch, frames, height, width, 3]; progress responses carry `step` only. diffusers runs the pipeline
(UMT5, the initial noise from a CPU generator seeded with `seed`, the scheduler loop with classifier-free guidance,
Wan 2.2's switch from its high-noise to its low-noise expert at boundary_ratio, the VAE), so a video equals
diffusers' for the same components; its transformers are our engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families.family import PipelinePart, Signature
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (check_batch, check_frames, check_sides, check_steps_and_guidance,
                                             prompts_of, text_length)
from mdtriton.pipeline.transformer import EngineAsTransformer

MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default and UMT5's length


class EngineTransformer(EngineAsTransformer):
    """WanPipeline's `transformer` (or `transformer_2`): a transformer engine called as WanTransformer3DModel is.

    Wan 2.2 TI2V 5B's pipelines pass a timestep per token (expand_timesteps); for text to video they are all the
    sample's timestep, which the engine takes once; given an image (WanImageToVideoPipeline) the first latent frame's
    tokens have timestep 0, and the engine takes one per token. Wan 2.1 I2V's pipeline passes its image encoder's
    tokens (encoder_hidden_states_image), which the engine takes beside the text.

    Guidance parallelism (cfg_size 2): WanPipeline calls the transformer for the conditional branch, then for the
    unconditional one, each named by its cache context, and combines them only after both (run_guided). A pipeline
    that does not guide (guidance_scale <= 1) makes no unconditional call: both groups then run the conditional
    one."""

    def __init__(self, engine: TorchEngine, pipeline: Any):
        super().__init__(engine)
        self.pipeline = pipeline
        self.branch = "cond"
        config = engine.manifest.config
        self.config = SimpleNamespace(in_channels=config["in_channels"], out_channels=config["out_channels"],
                                      patch_size=tuple(config["patch_size"]), image_dim=config["image_dim"])

    def cache_context(self, name: str, **step):
        """WanPipeline names each transformer call's branch ("cond", "uncond") by its cache context, which also tells
        guidance parallelism which call this is."""
        self.branch = name
        return super().cache_context(name)

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                attention_kwargs=None, return_dict=False):
        if timestep.ndim == 2 and bool((timestep == timestep[:, :1]).all()):
            timestep = timestep[:, 0]
        inputs = {"hidden_states": hidden_states.to(self._dtype), "timestep": timestep.float(),
                  "encoder_hidden_states": encoder_hidden_states.to(self._dtype)}
        if encoder_hidden_states_image is not None:
            inputs["encoder_hidden_states_image"] = encoder_hidden_states_image.to(self._dtype)
        if self.engine.comm.cfg_size == 1 or not self.pipeline.do_classifier_free_guidance:
            return (self.run_engine(inputs),)
        shape = (hidden_states.shape[0], self.config.out_channels, *hidden_states.shape[2:])
        return (self.run_guided(inputs, self.branch, shape),)


class WanPipelinePart(PipelinePart):
    diffusers_class = "WanPipeline"
    guidance_branches = True
    float32_components = ("vae",)  # as diffusers' Wan examples load it
    transformers = ("transformer", "transformer_2")
    request_timeout_s = 3600.0  # a 50-step 720p clip with guidance took 19 minutes on one H100 (diffusers)
    # Not TaylorSeer: diffusers' default TaylorSeer patterns ("^blocks.*attn") match no module of Wan's transformer
    # (its attentions are attn1 and attn2), so diffusers' TaylorSeer caches nothing there.
    cache_methods = ("first_block",)

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_frames", "INT32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("guidance_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
            TensorSpec("negative_prompt", "STRING", (-1,)),
            TensorSpec("max_sequence_length", "INT32", (1,)),
            TensorSpec("guidance_scale_2", "FP32", (1,)),
        )
        outputs = (TensorSpec("video", "UINT8", (-1, -1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0,
                "seed": 0, "negative_prompt": None, "max_sequence_length": None, "guidance_scale_2": None}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The VAE's compression (WanPipeline's vae_scale_factor_temporal and _spatial), and where the pipeline
        switches to its second expert (boundary_ratio; None: it has one transformer, and takes no guidance_scale_2)."""
        vae_config = json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())
        model_index = json.loads((Path(pipeline_dir) / "model_index.json").read_text())
        return {"vae_scale_factor_temporal": vae_config.get("scale_factor_temporal", 4),
                "vae_scale_factor_spatial": vae_config.get("scale_factor_spatial", 8),
                "boundary_ratio": model_index.get("boundary_ratio")}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8, a frame count the VAE cannot take (4k+1), sides that are not multiples of the
        VAE's compression times the patch, more tokens than the engine takes (naming what fits), step counts,
        guidance that is not finite, guidance_scale_2 without a second expert, a batch over the limit."""
        prompts = prompts_of(inputs, "prompt")
        if "negative_prompt" in inputs and len(prompts_of(inputs, "negative_prompt")) not in (1, len(prompts)):
            raise RequestError(f"negative_prompt has {inputs['negative_prompt'].shape[0]} rows, prompt {len(prompts)};"
                               " send one negative_prompt for all, or one per prompt")
        check_batch(manifest, prompts, "videos")
        config = manifest.config
        frames = check_frames(inputs, config["vae_scale_factor_temporal"], "Wan's clips: 81")
        height, width = check_sides(inputs, side_multiple(manifest), f"the VAE's {config['vae_scale_factor_spatial']}x "
                                                                     "compression times the transformer's patches")
        tokens = video_tokens(manifest, frames, height, width)
        if tokens > manifest.limits.max_tokens:
            raise RequestError(f"{width}x{height} x {frames} frames is {tokens} tokens, over this engine's maximum of "
                               f"{manifest.limits.max_tokens}; send fewer frames or a smaller size (the limit is set "
                               "at build time: mdtriton build --max-tokens)")
        text_length(inputs, MAX_SEQUENCE_LENGTH)
        check_steps_and_guidance(inputs, ("guidance_scale", "guidance_scale_2"), "Wan: 5.0")
        # (An engine built before boundary_ratio was kept has no word on it: diffusers refuses such a request then, on
        # every rank before any collective, and the request is answered with its message.)
        if "guidance_scale_2" in inputs and "boundary_ratio" in config and config["boundary_ratio"] is None:
            raise RequestError("guidance_scale_2 is the guidance of a second expert (Wan 2.2 A14B's low-noise "
                               "transformer), and this pipeline has one transformer: leave guidance_scale_2 out")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        arguments = {
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "height": int(inputs["height"][0]),
            "width": int(inputs["width"][0]),
            "num_frames": int(inputs["num_frames"][0]),
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
            "max_sequence_length": text_length(inputs, MAX_SEQUENCE_LENGTH),
        }
        if "negative_prompt" in inputs:
            negative = read_prompts(inputs["negative_prompt"], "negative_prompt")
            arguments["negative_prompt"] = negative[0] if len(negative) == 1 else negative
        if "guidance_scale_2" in inputs:
            arguments["guidance_scale_2"] = float(inputs["guidance_scale_2"][0])
        return arguments

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"video": UINT8 [batch, frames, height, width, 3]} of WanPipeline's frames [batch, frames, 3, H, W] in
        [0, 1], rounded as diffusers rounds images (in float32), on the pipeline's device."""
        return {"video": (result.frames.float().permute(0, 1, 3, 4, 2) * 255).round().to(torch.uint8)}

    def transformer(self, engine: TorchEngine, pipeline: Any) -> torch.nn.Module:
        return EngineTransformer(engine, pipeline)


def side_multiple(manifest: Manifest) -> int:
    """Heights and widths must be multiples of this: the VAE's spatial compression times the patch (16, or 32 for
    Wan 2.2 TI2V 5B)."""
    return manifest.config["vae_scale_factor_spatial"] * manifest.config["transformer"]["patch_size"][1]


def video_tokens(manifest: Manifest, frames: int, height: int, width: int) -> int:
    """The transformer's tokens for a video: latent frames x latent rows x latent columns, in patches."""
    config = manifest.config
    p_t, p_h, p_w = config["transformer"]["patch_size"]
    spatial = config["vae_scale_factor_spatial"]
    latent_frames = (frames - 1) // config["vae_scale_factor_temporal"] + 1
    return (latent_frames // p_t) * (height // spatial // p_h) * (width // spatial // p_w)
