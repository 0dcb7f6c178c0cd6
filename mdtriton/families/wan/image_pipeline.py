"""The Wan image-to-video pipeline served as one model ("wan-i2v-pipeline"): diffusers' WanImageToVideoPipeline,
an image and a prompt to video.

Its inputs are wan-pipeline's, and the conditioning `image` (UINT8 [height, width, 3], required: the video's first
frame) and `last_image` (optional: its last frame). diffusers runs the pipeline as for text to video; the image
reaches the transformer in three ways, by model: Wan 2.1 I2V's CLIP image encoder gives the image's tokens beside the
text (encoder_hidden_states_image), Wan 2.1 I2V and Wan 2.2 I2V A14B take the image's latents and a mask beside the
noise (36 input channels), and Wan 2.2 TI2V 5B (expand_timesteps) puts the image's latents in the first latent frame,
whose tokens then get timestep 0 (a timestep per token). Our engines serve all three (mdtriton.families.wan).
"""

from __future__ import annotations

import json
from pathlib import Path

import PIL.Image
import torch

from mdtriton.engine.manifest import Manifest, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families.family import Signature
from mdtriton.families.wan.pipeline import MAX_SEQUENCE_LENGTH, WanPipelinePart
from mdtriton.pipeline.request_checks import check_image, text_length


class WanImageToVideoPipelinePart(WanPipelinePart):
    diffusers_class = "WanImageToVideoPipeline"
    float32_components = ("vae", "image_encoder")  # as diffusers' Wan image-to-video examples load them

    def signature(self) -> Signature:
        inputs, outputs = super().signature()
        images = (TensorSpec("image", "UINT8", (-1, -1, 3)), TensorSpec("last_image", "UINT8", (-1, -1, 3)))
        return inputs[:1] + images + inputs[1:], outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {**super().optional_inputs(), "last_image": None}

    def pipeline_config(self, pipeline_dir: Path) -> dict:
        """wan-pipeline's, and whether the image replaces the first latent frame (expand_timesteps: Wan 2.2 TI2V)."""
        model_index = json.loads((Path(pipeline_dir) / "model_index.json").read_text())
        return {**super().pipeline_config(pipeline_dir), "expand_timesteps": bool(model_index.get("expand_timesteps"))}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """wan-pipeline's checks; then the images (sides and aspect), a last image only where the model takes one
        (not Wan 2.2 TI2V; with an image encoder, only one that reads two images: Wan 2.1 FLF2V), and for a model
        with an image encoder the whole text length (512: its transformer finds the image's tokens by it)."""
        super().check_inputs(manifest, inputs)
        config, transformer = manifest.config, manifest.config["transformer"]
        height, width = int(inputs["height"][0]), int(inputs["width"][0])
        for name in ("image", "last_image"):
            if name in inputs:
                check_image(inputs[name], height, width, name)
        if "last_image" in inputs:
            if config["expand_timesteps"]:
                raise RequestError("last_image: Wan 2.2 TI2V conditions only the first frame on an image; leave "
                                   "last_image out")
            if transformer["image_dim"] is not None and transformer["pos_embed_seq_len"] is None:
                raise RequestError("last_image: this model's image encoder reads one image (Wan 2.1 I2V; the first and "
                                   "last frame model is Wan 2.1 FLF2V); leave last_image out")
        if transformer["image_dim"] is not None and text_length(inputs, MAX_SEQUENCE_LENGTH) != MAX_SEQUENCE_LENGTH:
            raise RequestError(f"max_sequence_length: Wan 2.1 image-to-video takes the whole {MAX_SEQUENCE_LENGTH} "
                               "text tokens (its transformer tells the image's tokens from the text's by that length); "
                               "leave max_sequence_length out")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        arguments = super().call_arguments(manifest, inputs)
        for name in ("image", "last_image"):
            if name in inputs:
                arguments[name] = PIL.Image.fromarray(inputs[name].cpu().numpy())
        return arguments
