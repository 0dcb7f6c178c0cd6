"""gRPC client for models served by mdtriton (tritonclient underneath)."""
