"""LTX-2 served as one model: diffusers' LTX2Pipeline ("ltx2-pipeline"), prompt to video with sound, and
LTX2ImageToVideoPipeline ("ltx2-image-to-video-pipeline"), the same from a first frame, their
LTX2VideoTransformer3DModel split by sequence as diffusers declares it, mended (ltx2_context_parallel_plan), through
mdtriton.pipeline.generic.

Inputs are named after `LTX2Pipeline.__call__` (prompts as text: Triton's BYTES, read as UTF-8 rows), each optional
with the pipeline's default; its other settings (its spatio-temporal and modality guidance among them) are the
pipeline's defaults; image to video takes the first frame too (`image`, UINT8 [height, width, 3]: the pipeline resizes
it to the clip's size). Outputs: the clip's frames as UINT8 [batch, frames, height, width, 3], its sound as FP32
[batch, channels, samples] in [-1, 1], and the sound's sample rate (the vocoder's); progress responses carry `step`.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any

import torch

from mdtriton.engine.manifest import Manifest, Signature, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.generic import DiffusersPipelinePart
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import (check_batch, check_frames, check_image, check_sides,
                                             check_steps_and_guidance, prompts_of)

# LTX2Pipeline's text length (its default max_sequence_length): every prompt is padded to it.
TEXT_TOKENS = 1024
# LTX2Pipeline refuses sides that are not multiples of 32, whatever its VAE's compression.
PIPELINE_SIDE_MULTIPLE = 32
# The frame rates taken: LTX-2 is trained at 24 to 50; the rate sets the sound's length and the video's positions.
FRAME_RATE_RANGE = (1.0, 120.0)


def ltx2_context_parallel_plan(transformer: torch.nn.Module) -> dict:
    """LTX2VideoTransformer3DModel's `_cp_plan`, mended: its video RoPE is split along the tokens in either of its
    layouts ([B, tokens, D] interleaved, [B, heads, tokens, D/2] split: the declared plan splits only the first), and
    so is the RoPE of its audio-video cross-attention's video side (`cross_attn_rope`, which the declared plan leaves
    whole beside the split video queries and keys), and a timestep per video token (image to video: [B, tokens]; the
    declared plan leaves it whole). The audio stream is not split: every rank holds it whole."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    plan = dict(type(transformer)._cp_plan)
    plan[""] = {**plan[""], "timestep": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)}
    if transformer.config.rope_type == "split":
        tokens = ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)
        plan["rope"] = {0: tokens, 1: tokens}
    plan["cross_attn_rope"] = plan["rope"]
    return plan


class LTX2PipelinePart(DiffusersPipelinePart):
    diffusers_class = "LTX2Pipeline"
    guidance_branches = True
    guidance_in_batch = True  # the unconditional and conditional samples in one call, under "cond_uncond"
    cache_methods = ("taylorseer",)
    cache_note = ("First Block Cache: diffusers' block hooks know no LTX-2 block, and would pass a skipped block's "
                  "encoder_hidden_states (the text) on where LTX-2's blocks return the sound")
    # Its blocks compile with static sizes. With every size symbolic, LTX2VideoTransformerBlock's 20 tensor inputs (two
    # streams, their texts and text masks, 6 modulations, 4 RoPE pairs) made Dynamo and AOTAutograd reason about
    # ~190,000 symbolic size operations per graph: on CPU (tiny LTX-2, aot_eager) a block's compile took 25.8 s
    # against 2.5 s static (Qwen-Image's: 8.2 s against 6.0 s). And each kind of call compiled twice: the first block
    # takes views (the inputs as the transformer reshaped them), the second the first's outputs, and Dynamo guards the
    # symbolic sizes of a view's base, a guard that fails on a tensor with none. A guided step makes 3 kinds of call
    # (batch 2 with guidance, batch 1 with spatio-temporal guidance, batch 1 with the modalities isolated): 6 compiles,
    # and the tiny pipeline's first request took 191-290 s on CPU (Inductor; 135 s with aot_eager) where it runs in
    # about 2 s uncompiled. Static: 3 compiles, 61 s (12 s with aot_eager), the outputs equal. Each new size compiles
    # its 3 kinds again: torch's recompile limit (8 per code) holds two sizes, and calls past it run eagerly.
    compile_dynamic = False

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            TensorSpec("negative_prompt", "STRING", (-1,)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_frames", "INT32", (1,)),
            TensorSpec("frame_rate", "FP32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("guidance_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
        )
        outputs = (TensorSpec("video", "UINT8", (-1, -1, -1, -1, 3)), TensorSpec("audio", "FP32", (-1, -1, -1)),
                   TensorSpec("sample_rate", "INT32", (1,)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"negative_prompt": None, "height": 512, "width": 768, "num_frames": 121, "frame_rate": 24.0,
                "num_inference_steps": 30, "guidance_scale": 3.0, "seed": 0}

    def context_parallel_plan(self, transformer: torch.nn.Module) -> dict:
        return ltx2_context_parallel_plan(transformer)

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """The video VAE's compression in space and time (as AutoencoderKLLTX2Video derives it), the audio latents per
        second of sound (LTX2Pipeline's: sample rate / mel hop / the audio VAE's 4x in time) and the vocoder's sample
        rate."""
        pipeline_dir = Path(pipeline_dir)
        vae = json.loads((pipeline_dir / "vae" / "config.json").read_text())
        audio_vae = json.loads((pipeline_dir / "audio_vae" / "config.json").read_text())
        vocoder = json.loads((pipeline_dir / "vocoder" / "config.json").read_text())
        scaling = 2 ** sum(vae["spatio_temporal_scaling"])
        return {"vae_spatial": vae.get("spatial_compression_ratio") or vae["patch_size"] * scaling,
                "vae_temporal": vae.get("temporal_compression_ratio") or vae["patch_size_t"] * scaling,
                "audio_latents_per_second": audio_vae["sample_rate"] / audio_vae["mel_hop_length"] / 4,
                "sample_rate": vocoder.get("output_sampling_rate", audio_vae["sample_rate"])}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """Prompts that are not UTF-8, a negative prompt per prompt or one for all, a frame count the VAE cannot take,
        sides the pipeline and its VAE cannot take, a clip of fewer video tokens than the context-parallel ranks or of
        more than the model takes, a frame rate out of range or too high for one audio latent, step counts, a
        guidance out of range, a batch over the limit."""
        prompts = prompts_of(inputs, "prompt")
        if "negative_prompt" in inputs and len(prompts_of(inputs, "negative_prompt")) not in (1, len(prompts)):
            raise RequestError(f"negative_prompt has {inputs['negative_prompt'].shape[0]} rows, prompt {len(prompts)}; "
                               "send one negative_prompt for all, or one per prompt")
        check_batch(manifest, prompts, "videos")
        config = manifest.config
        frames = check_frames(inputs, config["vae_temporal"], "LTX-2's clips: 121")
        multiple = math.lcm(PIPELINE_SIDE_MULTIPLE, config["vae_spatial"])
        height, width = check_sides(inputs, multiple, f"LTX2Pipeline takes multiples of {PIPELINE_SIDE_MULTIPLE}, "
                                                      f"its VAE compresses {config['vae_spatial']}x")
        tokens = video_tokens(config, frames, height, width)
        if tokens > manifest.limits.max_tokens:
            raise RequestError(f"{width}x{height} x {frames} frames is {tokens} video tokens, over this model's maximum "
                               f"of {manifest.limits.max_tokens}; send fewer frames or a smaller size (the limit is set "
                               "at build time: mdtriton build --max-tokens)")
        if tokens < manifest.plan.cp_size:
            raise RequestError(f"{width}x{height} x {frames} frames is {tokens} video tokens, fewer than the "
                               f"{manifest.plan.cp_size} context-parallel ranks it is split among; send more frames or "
                               "a larger size")
        frame_rate = float(inputs["frame_rate"][0])
        low, high = FRAME_RATE_RANGE
        if not low <= frame_rate <= high:  # NaN too
            raise RequestError(f"frame_rate {frame_rate:g} is out of range; send {low:g} to {high:g} (LTX-2: 24)")
        if round(frames / frame_rate * config["audio_latents_per_second"]) < 1:
            shortest = 1 / (2 * config["audio_latents_per_second"])
            raise RequestError(f"{frames} frames at frame_rate {frame_rate:g} last {frames / frame_rate:.3f} s, too "
                               f"short for the sound (at least {shortest:.3f} s); send more frames or a lower "
                               f"frame_rate (at most {frames / shortest:g})")
        check_steps_and_guidance(inputs, ("guidance_scale",), "LTX-2: 3.0")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        prompts = read_prompts(inputs["prompt"], "prompt")
        negative = read_prompts(inputs["negative_prompt"], "negative_prompt") if "negative_prompt" in inputs else None
        return {
            "prompt": prompts,
            "negative_prompt": negative * len(prompts) if negative is not None and len(negative) == 1 else negative,
            "height": int(inputs["height"][0]),
            "width": int(inputs["width"][0]),
            "num_frames": int(inputs["num_frames"][0]),
            "frame_rate": float(inputs["frame_rate"][0]),
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "guidance_scale": float(inputs["guidance_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
        }

    def guides(self, pipeline: Any, arguments: dict) -> bool:
        """As LTX2Pipeline decides: guidance_scale or audio_guidance_scale (the pipeline's default: a request does not
        set it) over 1."""
        audio_guidance = inspect.signature(type(pipeline).__call__).parameters["audio_guidance_scale"].default
        return arguments["guidance_scale"] > 1 or (audio_guidance or arguments["guidance_scale"]) > 1

    def outputs(self, result: Any) -> dict[str, torch.Tensor]:
        """{"video": UINT8 [batch, frames, height, width, 3] of the frames [batch, frames, 3, H, W] in [0, 1], rounded
        as diffusers' numpy_to_pil; "audio": FP32 [batch, channels, samples]}."""
        video = (result.frames.float().permute(0, 1, 3, 4, 2) * 255).round().to(torch.uint8)
        return {"video": video, "audio": result.audio.float()}

    def outputs_of(self, manifest: Manifest, result: Any) -> dict[str, torch.Tensor]:
        """outputs, and "sample_rate": INT32 [1], the sound's samples per second (the vocoder's)."""
        outputs = self.outputs(result)
        rate = torch.tensor([manifest.config["sample_rate"]], dtype=torch.int32, device=outputs["audio"].device)
        return {**outputs, "sample_rate": rate}


class LTX2ImageToVideoPipelinePart(LTX2PipelinePart):
    diffusers_class = "LTX2ImageToVideoPipeline"

    def signature(self) -> Signature:
        inputs, outputs = super().signature()
        return (TensorSpec("image", "UINT8", (-1, -1, 3)),) + inputs, outputs

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """LTX2PipelinePart's checks, and an image of a bounded size and aspect (check_image)."""
        super().check_inputs(manifest, inputs)
        check_image(inputs["image"], int(inputs["height"][0]), int(inputs["width"][0]))

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        """LTX2PipelinePart's, and the image as the PIL image the pipeline takes (it re-compresses a PIL image as
        LTX-2 was trained, image_crf)."""
        from PIL import Image

        return {**super().call_arguments(manifest, inputs), "image": Image.fromarray(inputs["image"].cpu().numpy())}


def video_tokens(config: dict, frames: int, height: int, width: int) -> int:
    """The transformer's video tokens for a clip: latent frames x latent rows x latent columns (LTX-2's patches are
    1x1x1)."""
    latent_frames = (frames - 1) // config["vae_temporal"] + 1
    return latent_frames * (height // config["vae_spatial"]) * (width // config["vae_spatial"])


LTX2 = LTX2PipelinePart()
LTX2_IMAGE_TO_VIDEO = LTX2ImageToVideoPipelinePart()
