"""The served signature of a FLUX pipeline model: inputs named after `FluxPipeline.__call__`, image out.

Progress responses carry `step` (steps finished) only; the last response carries `image` too.
"""

from __future__ import annotations

from mdtriton.engine.manifest import TensorSpec

ARCHITECTURE = "flux-pipeline"
# The components beside the transformer engine, as diffusers names their folders (model_index.json too).
COMPONENTS = ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae")
TRANSFORMER_DIR = "transformer"
OPTIONAL_INPUTS = ("prompt_2", "max_sequence_length")
# FluxPipeline's default and largest T5 sequence length.
MAX_SEQUENCE_LENGTH = 512
MAX_STEPS = 1000


def pipeline_signature() -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs of every FLUX pipeline model (prompts as UTF-8 rows: mdtriton.pipeline.prompts)."""
    inputs = (
        TensorSpec("prompt", "UINT8", (-1, -1)),
        TensorSpec("height", "INT32", (1,)),
        TensorSpec("width", "INT32", (1,)),
        TensorSpec("num_inference_steps", "INT32", (1,)),
        TensorSpec("guidance_scale", "FP32", (1,)),
        TensorSpec("seed", "INT64", (1,)),
        TensorSpec("prompt_2", "UINT8", (-1, -1)),
        TensorSpec("max_sequence_length", "INT32", (1,)),
    )
    outputs = (TensorSpec("image", "UINT8", (-1, -1, -1, 3)), TensorSpec("step", "INT32", (1,)))
    return inputs, outputs
