"""Whole pipelines served as one multi-rank model: prompt in, image out, the denoising loop on the server."""
