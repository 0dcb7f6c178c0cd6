"""One Triton model instance = one rank: load this rank's engine shard, then serve requests with all ranks."""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack

from mdtriton.backend.freeze_watchdog import FreezeWatchdog
from mdtriton.backend.job_runner import JobRunner, RanksUnavailable
from mdtriton.backend.metrics import RankMetrics
from mdtriton.backend.placement import placement_from_args
from mdtriton.backend.rendezvous import Rendezvous, rendezvous_dir
from mdtriton.engine.comm import Communicator
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.request_check import RequestError
from mdtriton.pipeline.serving import check_request, engine_class

log = logging.getLogger("mdtriton.backend")

# How long initialize() waits for the other ranks before letting Triton go on: long enough for ranks loaded
# in parallel to meet, so a loaded model answers at once; short, because Triton may load the instances one
# after another (the others can only join after this one returns). A rank that cannot load tells the others
# (Rendezvous.fail), which then stop waiting at once. Requests that come before the ranks have met wait for
# them (up to request_timeout_s).
INITIALIZE_JOIN_WAIT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = "30"
# How long past a job's deadline a request waits for the runner's own verdict on it.
RUNNER_GRACE_S = 2.0


class TritonLogHandler(logging.Handler):
    """Python logging records into Triton's log (pb_utils.Logger), where operators read the server's log."""

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


def error_response(message: str, code) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def send(sender, response, flags: int = 0) -> None:
    """Send a decoupled model's response; one that cannot go (the client has gone) is logged, not raised: the ranks'
    job goes on, and the instance keeps serving."""
    try:
        sender.send(response, flags=flags)
    except Exception as error:  # noqa: BLE001 - whatever the sender raises, the request is lost, not the rank
        log.warning("could not send a response (the client may have gone): %s", error)


def send_progress(sender, done: int, total: int) -> None:
    """One progress response of a decoupled model: `step`, the steps done so far (of total)."""
    step = torch.tensor([done], dtype=torch.int32)
    send(sender, pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor.from_dlpack("step", to_dlpack(step))]))


def read_parameters(config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


class RankModel:
    def __init__(self, args: dict):
        if not log.handlers:
            log.addHandler(TritonLogHandler())
            log.setLevel(logging.INFO)
        config = json.loads(args["model_config"])
        parameters = read_parameters(config)
        self.placement = placement_from_args(args, config)
        self.request_timeout = float(parameters.get("request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S))
        # Decoupled models (pipelines) answer through each request's response sender: progress, then the result.
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        join_timeout = float(parameters.get("join_timeout_s", "600"))
        if self.placement.device.type == "cuda":
            torch.cuda.set_device(self.placement.device)
        elif "OMP_NUM_THREADS" not in os.environ:
            # The ranks share this machine's cores; torch's default (a thread per core in every rank) would
            # oversubscribe them world_size times (3.6x slower with 2 ranks on 2 cores).
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.placement.world_size))
        rendezvous = Rendezvous(rendezvous_dir(args["model_name"], args["model_version"]),
                                self.placement.rank, self.placement.world_size)
        entered = rendezvous.enter()
        try:
            self._load(args, parameters)
        except Exception as error:
            # Tell the other ranks now, so they give up at once instead of waiting for this one.
            rendezvous.fail(entered, f"{type(error).__name__}: {error}")
            raise
        self.runner = JobRunner(self.engine, rendezvous, entered, join_timeout, timeout=self.request_timeout,
                                metrics=self.metrics, on_replaced=self._on_replaced)
        self.runner.start()
        self.freeze_watchdog = FreezeWatchdog(self._on_freeze).start()
        if not self.runner.wait_ready(INITIALIZE_JOIN_WAIT_S):
            if self.runner.gave_up:
                # Fail this instance's load too: Triton 2.51 was seen to crash (SIGSEGV) warming up one instance
                # of a model while another instance of it failed to initialize.
                self.finalize()
                raise EngineError(self.runner.gave_up)
            log.warning("rank %d: the other ranks have not joined yet; carrying on in the background",
                        self.placement.rank)

    def _load(self, args: dict, parameters: dict[str, str]) -> None:
        """Read the manifest, check it against the instances, and load this rank's shard of the engine."""
        engine_dir = Path(args["model_repository"]) / args["model_version"] / parameters.get("engine_dir", "engine")
        self.manifest = manifest = Manifest.read(engine_dir)
        if manifest.plan.world_size != self.placement.world_size:
            raise EngineError(f"{engine_dir}: engine has {manifest.plan.world_size} ranks ({manifest.plan}) but the "
                              f"model config starts {self.placement.world_size} instances; they must match")
        comm = Communicator(manifest.plan, self.placement.rank, self.placement.device)
        self.metrics = RankMetrics(args["model_name"], args["model_version"], comm.rank, comm.device)
        comm.collective_timer = self.metrics.time_collective
        self.engine = engine_class(manifest).load(engine_dir, comm)
        log.info("rank %d/%d loaded %s on %s in %.2f s", comm.rank, manifest.plan.world_size, engine_dir,
                 self.placement.device, self.engine.load_seconds)

    def execute(self, requests: list) -> list | None:
        self.freeze_watchdog.check()
        self.metrics.received(len(requests))
        senders = [request.get_response_sender() for request in requests] if self.decoupled else [None] * len(requests)
        # Submit every request first so all of them are ordered and running before we wait on any.
        submitted = [self._submit(request, sender) for request, sender in zip(requests, senders)]
        if not self.decoupled:
            return [self._answer(item) for item in submitted]
        for sender, item in zip(senders, submitted):
            send(sender, self._answer(item), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _submit(self, request, sender):
        """The request's job, or the error response that answers it now; sender (decoupled models) gets progress."""
        try:
            inputs = self._inputs(request)
            check_request(self.manifest, inputs)
            return self.runner.submit(inputs, on_progress=partial(send_progress, sender) if sender else None)
        except RequestError as error:
            return error_response(str(error), pb_utils.TritonError.INVALID_ARG)
        except RanksUnavailable as error:
            return error_response(str(error), pb_utils.TritonError.UNAVAILABLE)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: answer this request, keep serving
            log.error("rank %d could not take a request: %r", self.placement.rank, error)
            return error_response(f"rank {self.placement.rank} could not take this request: {error}",
                                  pb_utils.TritonError.INTERNAL)

    def _inputs(self, request) -> dict[str, torch.Tensor]:
        inputs = {}
        for spec in self.manifest.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is not None:
                inputs[spec.name] = torch.from_dlpack(tensor.to_dlpack())
        return inputs

    def _answer(self, item):
        """The response to a request: its error response as it is, or its job's outputs (or failure)."""
        return item if isinstance(item, pb_utils.InferenceResponse) else self._response(item)

    def _response(self, job):
        try:
            # The runner fails a job that missed its deadline, saying why; this wait is only a backstop.
            outputs = job.result.result(timeout=max(job.deadline - time.monotonic(), 0.0) + RUNNER_GRACE_S)
        except FutureTimeout:
            stuck = self.runner.ranks_not_running()
            return error_response(f"no answer from all ranks within {self.request_timeout:.0f} s (request_timeout_s in "
                                  f"config.pbtxt){': ' + stuck if stuck else ''}", pb_utils.TritonError.UNAVAILABLE)
        except RanksUnavailable as error:
            return error_response(str(error), pb_utils.TritonError.UNAVAILABLE)
        tensors = [pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous())) for name, value in outputs.items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _on_freeze(self, seconds: float) -> None:
        log.error("rank %d was frozen for %.1f s (SIGSTOP?); Triton may have declared this stub unhealthy, and "
                  "serving on would crash the server, so this process exits: reload the model to recover",
                  self.placement.rank, seconds)
        os._exit(1)

    def _on_replaced(self) -> None:
        # Exiting would be cleaner, but tritonserver 2.51 was seen to abort (boost::interprocess::lock_exception)
        # when this stub, which it never finalizes, exits: so give back the weights and stay, idle.
        log.warning("rank %d: a new load of this model has replaced this broken one; this rank gives back its "
                    "weights and stays idle until the server stops", self.placement.rank)
        self.engine = self.runner.engine = None
        gc.collect()
        if self.placement.device.type == "cuda":
            torch.cuda.empty_cache()

    def finalize(self) -> None:
        self.freeze_watchdog.stop()
        self.runner.stop()
