"""The Triton Python backend side: ranks, rendezvous, and running every request on all ranks."""
