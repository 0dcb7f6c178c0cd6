"""mdtriton: one model served across N GPUs by NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
