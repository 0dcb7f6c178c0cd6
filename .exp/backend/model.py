"""Triton Python backend entry point of an mdtriton model; `mdtriton build` copies it into each version.

All logic lives in the installed `mdtriton` package (see mdtriton.backend.rank_model), which must be
importable by the backend's Python (our embedded server arranges that; for a stock Triton container
see docs/deploy.md).
"""

from mdtriton.backend.rank_model import RankModel


class TritonPythonModel:
    def initialize(self, args):
        self.rank_model = RankModel(args)

    def is_ready(self):
        """Whether this instance can serve now: false while the ranks have not formed, are re-forming after a
        failure, or have lost a rank for good. Triton asks from 2.67 on (server readiness follows from 2.68);
        Triton 2.51, our embedded server, never calls it (docs/deploy.md)."""
        return self.rank_model.is_ready()

    def execute(self, requests):
        return self.rank_model.execute(requests)

    def finalize(self):
        self.rank_model.finalize()
