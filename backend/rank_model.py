"""One Triton model instance = one rank: a thin stub that keeps a worker process for its rank (which loads the
rank's engine shard and runs every request with the other ranks' workers) and hands it this instance's requests."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack

from mdtriton.backend.job_scheduler import MIN_SPEEDUP
from mdtriton.backend.messages import RanksUnavailable
from mdtriton.backend.metrics import RankMetrics
from mdtriton.backend.placement import placement_from_args
from mdtriton.backend.rendezvous import rendezvous_dir
from mdtriton.backend.stub_watchdog import StubWatchdog
from mdtriton.backend.worker_keeper import PoisonRequest, WorkerKeeper
from mdtriton.backend.worker_spec import WorkerSpec
from mdtriton.engine.job_control import JobFailed, JobStopped
from mdtriton.engine.manifest import EngineError, Manifest
from mdtriton.engine.request_check import RequestError
from mdtriton.serving import (DEFAULT_REQUEST_TIMEOUT_S, check_architecture, check_request, text_input,
                              with_defaults)
from mdtriton.lora.directory import DEFAULT_CACHE_MIB, adapters_dir

log = logging.getLogger("mdtriton.backend")

# How long initialize() waits for the other ranks before letting Triton go on: long enough for ranks loaded
# in parallel to meet, so a loaded model answers at once; short, because Triton may load the instances one
# after another (the others can only join after this one returns). A rank that cannot load tells the others
# (Rendezvous.fail), which then stop waiting at once. Requests that come before the ranks have met wait for
# them (up to request_timeout_s).
INITIALIZE_JOIN_WAIT_S = 5.0
# How often a stub waiting for an answer asks Triton whether the request's client cancelled it (or went away).
CANCEL_POLL_S = 0.1
# A rank whose worker dies more than this many times within the window is given up (config.pbtxt parameters
# heal_limit and heal_window_s).
DEFAULT_HEAL_LIMIT = "10"
DEFAULT_HEAL_WINDOW_S = "600"


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
    """A request's error answer: one line (an exception's text may have several: a library's, a rank's)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(" ".join(message.splitlines()), code))


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


def see_python_path() -> None:
    """Put PYTHONPATH's entries on this stub's sys.path, after its own: Triton 2.51's stub embeds Python without
    reading PYTHONPATH, where its rank worker (a plain `python`) and the build do. So the stub finds the same
    packages as they, e.g. a model family installed there (mdtriton.families: entry points)."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)


def read_parameters(config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


class RankModel:
    def __init__(self, args: dict):
        if not log.handlers:
            log.addHandler(TritonLogHandler())
            log.setLevel(logging.INFO)
        see_python_path()
        config = json.loads(args["model_config"])
        parameters = read_parameters(config)
        self.parameters = parameters
        self.placement = placement_from_args(args, config)
        # The stub only wraps tensors and checks their shapes (the worker reads their values): one torch thread.
        # Torch's default pool (a thread per core) keeps spinning after each parallel operation, on the cores a CPU
        # rank's worker computes on.
        torch.set_num_threads(1)
        self.request_timeout = float(parameters.get("request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S))
        if not (math.isfinite(self.request_timeout) and self.request_timeout > 0):  # a config.pbtxt edited by hand
            raise EngineError(f"config.pbtxt's request_timeout_s is {self.request_timeout:g}: give a positive number of "
                              "seconds")
        # Decoupled models (pipelines) answer through each request's response sender: progress, then the result.
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        engine_dir = Path(args["model_repository"]) / args["model_version"] / parameters.get("engine_dir", "engine")
        # A pipeline's LoRA adapters are the model's, beside its versions (mdtriton.lora).
        self.adapters_dir = adapters_dir(Path(args["model_repository"]))
        self.manifest = Manifest.read(engine_dir)
        # Now, not at the first request this rank receives (part of the 0.1-0.5 s more that each rank's first answer
        # took on 4 x H200: docs/benchmarks.md); an architecture that is not installed fails the load.
        check_architecture(self.manifest)
        if self.manifest.plan.world_size != self.placement.world_size:
            raise EngineError(f"{engine_dir}: engine has {self.manifest.plan.world_size} ranks ({self.manifest.plan}) "
                              f"but the model config starts {self.placement.world_size} instances; they must match")
        self.metrics = RankMetrics(args["model_name"], args["model_version"], self.placement.rank)
        spec = WorkerSpec(engine_dir=str(engine_dir), rank=self.placement.rank, device=str(self.placement.device),
                          rendezvous_dir=str(rendezvous_dir(args["model_name"], args["model_version"])),
                          request_timeout=self.request_timeout, adapters_dir=str(self.adapters_dir),
                          lora_cache_mib=int(parameters.get("lora_cache_mib", DEFAULT_CACHE_MIB)),
                          join_timeout=float(parameters.get("join_timeout_s", "600")),
                          threads=self._cpu_threads(), elastic_min_speedup=self._elastic_min_speedup(parameters))
        # Started before the worker keeper, whose thread messages the server: the watchdog takes this process's parent,
        # now, as the server to watch (a stub whose server died before that would never see it go).
        self.watchdog = StubWatchdog(self._on_freeze, self._on_server_gone).start()
        self.workers = WorkerKeeper(spec, self.placement.world_size,
                                    heal_limit=int(parameters.get("heal_limit", DEFAULT_HEAL_LIMIT)),
                                    heal_window_s=float(parameters.get("heal_window_s", DEFAULT_HEAL_WINDOW_S)),
                                    on_job_timed=self.metrics.job_done,
                                    on_queue_length=self.metrics.queue_length).start()
        if not self.workers.wait_serving(INITIALIZE_JOIN_WAIT_S):
            if self.workers.given_up:
                # Fail this instance's load too: Triton 2.51 was seen to crash (SIGSEGV) warming up one instance
                # of a model while another instance of it failed to initialize.
                self.finalize()
                raise EngineError(self.workers.given_up)
            log.warning("rank %d: the other ranks have not joined yet; carrying on in the background",
                        self.placement.rank)

    def _cpu_threads(self) -> int | None:
        """Torch threads for a CPU rank's worker: the ranks share this machine's cores, and torch's default (a
        thread per core in every rank) would oversubscribe them world_size times (3.6x slower with 2 ranks on 2
        cores). None (torch's default) on GPU, or when OMP_NUM_THREADS says otherwise."""
        if self.placement.device.type == "cuda" or "OMP_NUM_THREADS" in os.environ:
            return None
        return max(1, len(os.sched_getaffinity(0)) // self.placement.world_size)

    @staticmethod
    def _elastic_min_speedup(parameters: dict) -> float:
        """config.pbtxt's elastic_min_speedup (default job_scheduler.MIN_SPEEDUP): how many times as fast a larger
        group must run a lone request of an elastic model for the request to take it; 0 gives every lone request the
        largest free group."""
        text = parameters.get("elastic_min_speedup", str(MIN_SPEEDUP))
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise EngineError(f"config.pbtxt's elastic_min_speedup is {text!r}: give a number of 0 or more (default "
                              f"{MIN_SPEEDUP:g}; 0: a lone request always takes every free rank)")
        return value

    def is_ready(self) -> bool:
        """Whether this rank is serving with all the others now (TritonPythonModel.is_ready): false while the
        ranks start, heal, or have been given up."""
        return self.workers.serving

    def execute(self, requests: list) -> list | None:
        self.watchdog.check()
        if self.manifest.plan.elastic:
            return self._execute_elastic(requests)
        senders = [request.get_response_sender() for request in requests] if self.decoupled else [None] * len(requests)
        # Each request's one deadline, set here, as this stub receives it: the stub answers UNAVAILABLE at it, and the
        # ranks drop its job if it has not started by then, or stop it after its next step.
        deadline = time.monotonic() + self.request_timeout
        # Submit every request first so all of them are ordered and running before we wait on any.
        submitted = [self._submit(request, sender, deadline) for request, sender in zip(requests, senders)]
        # Counted while the worker runs them, not before: a metric update is a round trip to the server process.
        self.metrics.received(len(requests))
        if not self.decoupled:
            return [self._answer(item, request.is_cancelled) for request, item in zip(requests, submitted)]
        for sender, item in zip(senders, submitted):
            send(sender, self._answer(item, sender.is_cancelled), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _execute_elastic(self, requests: list) -> None:
        """An elastic model's requests: submitted, then answered each from a thread of its own through its response
        sender (unary and streaming models alike), so that this instance takes its next requests at once. The ranks'
        job hub must see every request that waits to run them at once on groups of ranks: an instance that waited
        for its answer would leave the next requests in Triton's queue, where the hub cannot see them."""
        deadline = time.monotonic() + self.request_timeout
        for request in requests:
            sender = request.get_response_sender()
            item = self._submit(request, sender if self.decoupled else None, deadline, own_copy=True)
            threading.Thread(target=self._answer_later, args=(sender, item), name="mdtriton-answer",
                             daemon=True).start()
        self.metrics.received(len(requests))
        return None

    def _answer_later(self, sender, item) -> None:
        send(sender, self._answer(item, sender.is_cancelled), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _submit(self, request, sender, deadline: float, own_copy: bool = False):
        """The request's job, or the error response that answers it now; sender (decoupled models) gets progress;
        deadline: the time.monotonic() by which the ranks must answer it; own_copy: the inputs copied out of Triton's
        memory (a request answered after execute returns)."""
        try:
            inputs = self._inputs(request)
            if own_copy:
                inputs = {name: tensor.clone() for name, tensor in inputs.items()}
            inputs = with_defaults(self.manifest, inputs, self.parameters)
            check_request(self.manifest, inputs, self.adapters_dir)
            return self.workers.submit(inputs, deadline, on_progress=partial(send_progress, sender) if sender else None)
        except RequestError as error:
            return error_response(str(error), pb_utils.TritonError.INVALID_ARG)
        except RanksUnavailable as error:
            return error_response(str(error), pb_utils.TritonError.UNAVAILABLE)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: answer this request, keep serving
            log.error("rank %d could not take a request: %r", self.placement.rank, error)
            return error_response(f"rank {self.placement.rank} could not take this request: {error}",
                                  pb_utils.TritonError.INTERNAL)

    def _inputs(self, request) -> dict[str, torch.Tensor]:
        """The request's inputs by name, in the manifest's order; text (BYTES, the only input read through numpy: it has
        no DLPack) as UTF-8 rows. (request.inputs() once: pb_utils's
        get_input_tensor_by_name calls it once per name, which took 45 µs instead of 18 for 7 inputs.)"""
        given = {tensor.name(): tensor for tensor in request.inputs()}
        return {spec.name: text_input(self.manifest, spec, given[spec.name].as_numpy().reshape(-1))
                if spec.data_type == "STRING"
                else torch.from_dlpack(given[spec.name].to_dlpack())
                for spec in self.manifest.inputs if spec.name in given}

    def _answer(self, item, is_cancelled):
        """The response to a request: its error response as it is, or its request's outputs (or failure);
        is_cancelled: Triton's word on whether the client has cancelled it (or gone)."""
        return item if isinstance(item, pb_utils.InferenceResponse) else self._response(item, is_cancelled)

    def _response(self, request, is_cancelled):
        """Wait for the request's answer, looking every CANCEL_POLL_S whether its client cancelled it; at its deadline,
        or once cancelled, give it up: the ranks drop its job, or stop it after its next step."""
        try:
            while True:
                try:
                    outputs = request.answer.result(timeout=max(min(request.deadline - time.monotonic(),
                                                                    CANCEL_POLL_S), 0.0))
                    break
                except FutureTimeout:
                    if time.monotonic() >= request.deadline:
                        return self._give_up(request)
                    if is_cancelled():
                        self.workers.give_up(request, "cancelled by its client")
                        return error_response("the request was cancelled", pb_utils.TritonError.CANCELLED)
            tensors = [pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous()))
                       for name, value in outputs.items()]
        except RequestError as error:  # the ranks refused it (inputs not finite, an adapter they cannot use)
            return error_response(str(error), pb_utils.TritonError.INVALID_ARG)
        except RanksUnavailable as error:
            return error_response(str(error), pb_utils.TritonError.UNAVAILABLE)
        except JobStopped as error:  # the ranks stopped it after a step: its deadline passed, or its client cancelled
            return error_response(f"the request was {error} (its deadline passed, request_timeout_s "
                                  f"{self.request_timeout:g} s in config.pbtxt, or its client cancelled it)",
                                  pb_utils.TritonError.UNAVAILABLE)
        except (PoisonRequest, JobFailed) as error:
            return error_response(str(error), pb_utils.TritonError.INTERNAL)
        except Exception as error:  # noqa: BLE001 - anything else: a one-line answer, never a traceback
            log.error("rank %d: a request's answer failed: %r", self.placement.rank, error)
            return error_response(f"rank {self.placement.rank} could not answer this request: "
                                  f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _give_up(self, request) -> "pb_utils.InferenceResponse":
        """The answer to a request whose deadline has passed: the ranks were busy, healing, or stuck."""
        self.workers.give_up(request, "past its deadline")
        status = self.workers.status()
        if status:
            what = status
        elif request.running:
            what = "its job was running, and stops after its next step"
        else:
            what = "it waited for the ranks, busy with other requests, and was dropped without running"
        return error_response(f"no answer from all ranks within {self.request_timeout:.0f} s (request_timeout_s in "
                              f"config.pbtxt): {what}", pb_utils.TritonError.UNAVAILABLE)

    def _on_freeze(self, seconds: float) -> None:
        log.error("rank %d was frozen for %.1f s (SIGSTOP?); Triton may have declared this stub unhealthy, and "
                  "serving on would crash the server, so this process exits: reload the model to recover",
                  self.placement.rank, seconds)
        os._exit(1)

    def _on_server_gone(self) -> None:
        # No log: Triton's log and the server's stderr may be gone with it. The rank worker dies with this process.
        os._exit(1)

    def finalize(self) -> None:
        self.watchdog.stop()
        self.workers.stop()
