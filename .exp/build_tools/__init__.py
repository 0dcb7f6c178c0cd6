"""Build tools: engines and their Triton model repository entries."""
