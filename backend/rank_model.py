"""One Triton model instance = one rank: load this rank's engine shard, then serve requests with all ranks."""

from __future__ import annotations

import json
import logging
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack

from mdtriton.backend.job_runner import JobRunner, RanksUnavailable
from mdtriton.backend.metrics import RankMetrics
from mdtriton.backend.placement import placement_from_args
from mdtriton.backend.rendezvous import Rendezvous, rendezvous_dir
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import EngineError, Manifest

log = logging.getLogger("mdtriton.backend")

# How long initialize() waits for the other ranks before letting Triton go on (it may be loading the
# instances one after another, and the others can only join after this one returns).
INITIALIZE_JOIN_WAIT_S = 20.0


class BadRequest(Exception):
    """A request the engine cannot take; sent back as INVALID_ARG."""


def error_response(message: str, code) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def read_parameters(config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


class RankModel:
    def __init__(self, args: dict):
        config = json.loads(args["model_config"])
        parameters = read_parameters(config)
        self.placement = placement_from_args(args, config)
        self.request_timeout = float(parameters.get("request_timeout_s", "300"))
        join_timeout = float(parameters.get("join_timeout_s", "600"))
        if self.placement.device.type == "cuda":
            torch.cuda.set_device(self.placement.device)
        engine_dir = Path(args["model_repository"]) / args["model_version"] / parameters.get("engine_dir", "engine")
        manifest = Manifest.read(engine_dir)
        if manifest.plan.world_size != self.placement.world_size:
            raise EngineError(f"{engine_dir}: engine has {manifest.plan.world_size} ranks ({manifest.plan}) but the "
                              f"model config starts {self.placement.world_size} instances; they must match")
        comm = Communicator(manifest.plan, self.placement.rank, self.placement.device)
        self.metrics = RankMetrics(args["model_name"], args["model_version"], comm.rank, comm.device)
        comm.collective_timer = self.metrics.time_collective
        self.engine = TorchEngine.load(engine_dir, comm)
        log.info("rank %d/%d loaded %s on %s in %.2f s", comm.rank, manifest.plan.world_size, engine_dir,
                 self.placement.device, self.engine.load_seconds)
        self.inputs = {spec.name: spec for spec in manifest.inputs}
        rendezvous = Rendezvous(rendezvous_dir(args["model_name"], args["model_version"]),
                                comm.rank, manifest.plan.world_size)
        self.runner = JobRunner(self.engine, rendezvous, join_timeout, collective_timeout=self.request_timeout,
                                metrics=self.metrics)
        self.runner.start()
        if not self.runner.wait_ready(INITIALIZE_JOIN_WAIT_S):
            log.warning("rank %d: the other ranks have not joined yet; carrying on in the background", comm.rank)

    def execute(self, requests: list) -> list:
        self.metrics.received(len(requests))
        # Submit every request first so all of them are ordered and running before we wait on any.
        submitted = []
        for request in requests:
            try:
                submitted.append(self.runner.submit(self._inputs(request), self.request_timeout))
            except BadRequest as error:
                submitted.append(error_response(str(error), pb_utils.TritonError.INVALID_ARG))
            except RanksUnavailable as error:
                submitted.append(error_response(str(error), pb_utils.TritonError.UNAVAILABLE))
        return [item if isinstance(item, pb_utils.InferenceResponse) else self._response(item) for item in submitted]

    def _inputs(self, request) -> dict[str, torch.Tensor]:
        inputs = {}
        for name, spec in self.inputs.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise BadRequest(f"input {name!r} is missing")
            value = torch.from_dlpack(tensor.to_dlpack())
            if value.numel() == 0:
                raise BadRequest(f"input {name!r} is empty (shape {list(value.shape)})")
            inputs[name] = value
        return inputs

    def _response(self, job):
        try:
            outputs = job.result.result(timeout=self.request_timeout)
        except FutureTimeout:
            return error_response(f"no answer from all ranks within {self.request_timeout:.0f} s",
                                  pb_utils.TritonError.UNAVAILABLE)
        except RanksUnavailable as error:
            return error_response(str(error), pb_utils.TritonError.UNAVAILABLE)
        except Exception as error:  # noqa: BLE001 - an engine error answers this request, the model keeps serving
            return error_response(f"engine failed on this request: {error}", pb_utils.TritonError.INTERNAL)
        tensors = [pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous())) for name, value in outputs.items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self) -> None:
        self.runner.stop()
