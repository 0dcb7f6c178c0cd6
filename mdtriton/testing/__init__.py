"""What the tests and the benchmarks share: tiny pipelines and models with random weights, the random pipelines of the
published sizes, and readers of a running server's processes and metrics. Not needed to serve."""
