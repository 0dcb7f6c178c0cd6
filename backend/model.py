"""Triton Python backend entry point of an mdtriton model; `mdtriton build` copies it into each version.

All logic lives in the installed `mdtriton` package (see mdtriton.backend.rank_model), which must be
importable by the backend's Python (our embedded server arranges that; for a stock Triton container
see docs/deploy.md).
"""

from mdtriton.backend.rank_model import RankModel


class TritonPythonModel:
    def initialize(self, args):
        self.rank_model = RankModel(args)

    def execute(self, requests):
        return self.rank_model.execute(requests)

    def finalize(self):
        self.rank_model.finalize()
