"""Qwen-Image-Edit-Plus served as one model ("qwen-image-edit-plus-pipeline"): diffusers' QwenImageEditPlusPipeline,
one to three input images (`image`, `image_2`, `image_3`: mdtriton.pipeline.image_inputs) and a prompt to an edited
image, its QwenImageTransformer2DModel split by sequence as diffusers declares (mdtriton.pipeline.generic).

Inputs are named after `QwenImageEditPlusPipeline.__call__`, as Qwen-Image's (mdtriton.families.qwen_image); the
size left out is about a megapixel of the last input image's aspect, as in diffusers. Each input image is seen by the
text encoder (resized to about 384x384) and, resized to about a megapixel, appended to the image's tokens. One prompt
per request (the pipeline takes no batch).

The text encoder's processor is transformers' Qwen2VLProcessor, which transformers 5 loads only with its video
processor, and that needs torchvision; the pipeline never sends it a video, so every rank builds the processor from
the directory's `processor` folder without one (mdtriton.families.image_text_processor), and the pipeline loads where
torchvision does not import (CPU-only hosts: PyPI's torchvision wheels for torch 2.13 are CUDA builds).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mdtriton.engine.manifest import Manifest, Signature, TensorSpec
from mdtriton.engine.request_check import RequestError
from mdtriton.families.qwen_image import MAX_IMAGE_TOKENS, QwenImagePipelinePart
from mdtriton.pipeline.image_inputs import check_images, image_specs, pil_images
from mdtriton.pipeline.prompts import read_prompts
from mdtriton.pipeline.request_checks import check_sides, check_steps_and_guidance, prompts_of

# What the pipeline takes of an input image: sides of 32 pixels at least (its output's multiple), an aspect up to 8:1
# (Qwen-Image's published sizes reach 16:9; each input image is resized to a megapixel of its own aspect).
SMALLEST_INPUT_SIDE = 32
LARGEST_INPUT_ASPECT = 8.0


class QwenImageEditPlusPipelinePart(QwenImagePipelinePart):
    diffusers_class = "QwenImageEditPlusPipeline"

    def signature(self) -> Signature:
        inputs = (
            TensorSpec("prompt", "STRING", (-1,)),
            *image_specs(),
            TensorSpec("negative_prompt", "STRING", (-1,)),
            TensorSpec("height", "INT32", (1,)),
            TensorSpec("width", "INT32", (1,)),
            TensorSpec("num_inference_steps", "INT32", (1,)),
            TensorSpec("true_cfg_scale", "FP32", (1,)),
            TensorSpec("seed", "INT64", (1,)),
        )
        outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
        return inputs, outputs

    def optional_inputs(self) -> dict[str, int | float | None]:
        return {"image_2": None, "image_3": None, "negative_prompt": None, "height": None, "width": None,
                "num_inference_steps": 50, "true_cfg_scale": 4.0, "seed": 0}

    def load_arguments(self, pipeline_dir: Path) -> dict:
        """The text encoder's processor without a video processor (mdtriton.families.image_text_processor)."""
        # Imported here: transformers is needed where a rank loads the pipeline, not where a stub checks requests.
        from mdtriton.families.image_text_processor import image_text_processor

        return {"processor": image_text_processor(pipeline_dir)}

    def check_inputs(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> None:
        """One prompt, and a negative prompt or none; one to three input images in order, of sides and aspects the
        pipeline takes; sides (where given: both or neither) the VAE and the 2x2 patches take, up to the largest size;
        step counts (at least min_steps); a true_cfg_scale out of range."""
        prompts = prompts_of(inputs, "prompt")
        if len(prompts) != 1:
            raise RequestError(f"prompt has {len(prompts)} rows; Qwen-Image-Edit-Plus makes one image per request: "
                               "send one prompt")
        if "negative_prompt" in inputs and len(prompts_of(inputs, "negative_prompt")) != 1:
            raise RequestError(f"negative_prompt has {inputs['negative_prompt'].shape[0]} rows; send one, or none")
        check_images(inputs, SMALLEST_INPUT_SIDE, LARGEST_INPUT_ASPECT, "Qwen-Image-Edit-Plus")
        if ("height" in inputs) != ("width" in inputs):
            raise RequestError("send height and width together, or neither (about a megapixel of the last input "
                               "image's aspect)")
        if "height" in inputs:
            multiple = 2 * manifest.config["vae_scale_factor"]
            why = f"sides are multiples of {multiple}: the VAE's {multiple // 2}x compression times 2x2 patches"
            height, width = check_sides(inputs, multiple, why)
            if (height // multiple) * (width // multiple) > MAX_IMAGE_TOKENS:
                raise RequestError(f"{height}x{width} is over the largest image this model makes "
                                   f"({MAX_IMAGE_TOKENS} patches of {multiple}x{multiple} pixels); send a smaller size")
        check_steps_and_guidance(inputs, ("true_cfg_scale",), "Qwen-Image-Edit-Plus: 4.0")
        if int(inputs["num_inference_steps"][0]) < manifest.config["min_steps"]:
            raise RequestError(f"num_inference_steps {int(inputs['num_inference_steps'][0])} is too few for this "
                               f"pipeline's scheduler (its terminal shift); send {manifest.config['min_steps']} or "
                               "more")

    def call_arguments(self, manifest: Manifest, inputs: dict[str, torch.Tensor]) -> dict:
        return {
            "image": pil_images(inputs),
            "prompt": read_prompts(inputs["prompt"], "prompt"),
            "negative_prompt": (read_prompts(inputs["negative_prompt"], "negative_prompt")
                                if "negative_prompt" in inputs else None),
            "height": int(inputs["height"][0]) if "height" in inputs else None,
            "width": int(inputs["width"][0]) if "width" in inputs else None,
            "num_inference_steps": int(inputs["num_inference_steps"][0]),
            "true_cfg_scale": float(inputs["true_cfg_scale"][0]),
            "generator": torch.Generator().manual_seed(int(inputs["seed"][0])),
        }


QWEN_IMAGE_EDIT_PLUS = QwenImageEditPlusPipelinePart()
