"""Requests that end early, on a real tritonserver serving tiny pipelines on 2 and 3 CPU ranks (gloo): a request the
ranks cannot take, a failure on one rank before the collectives, a request cancelled by its client, requests past their
deadline behind others. Each is answered within seconds with its own status, the workers serve on (none restarted,
nothing healed) and the next request is right. Only a lost worker heals: a request's steps then go on from where they
were. A client that puts a bad request beside a good one on one stream does not take the server down.

Models: "flux" (FLUX.1-dev's layout, tensor-parallel on 2 ranks, streamed) and "wan" (Wan 2.1, tensor-parallel on 3
ranks, unary, request_timeout_s TIMEOUT_S: the overload test needs a short deadline).
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.grpc_client import ClientError
from mdtriton.client.pipeline import generate, generate_video, pipeline_inputs, video_inputs
from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan
from mdtriton.lora.adapter_file import Factors, write_adapter
from mdtriton.lora.directory import adapters_dir
from mdtriton.testing.metrics import scrape
from mdtriton.testing.triton_processes import memory_capped, rank_workers, worker_rank
from tests.conftest import start_server
from tests.pipeline.pipelines import max_level_difference, reference_image, save_pipelines
from mdtriton.testing.tiny_wan_pipeline import reference_video, save_tiny_wan_pipeline

TIMEOUT_S = 6.0
FLUX = dict(height=48, width=64, guidance_scale=3.5, seed=5)
WAN = dict(height=32, width=48, num_frames=9, guidance_scale=5.0, seed=4)
ANSWERED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("job_endings")
    flux_dir = save_pipelines(root)["dev"]
    wan_dir = save_tiny_wan_pipeline(root / "wan2.1", "wan2.1")
    repository = root / "repository"
    build_model_version(repository, "flux", BuildRequest(
        "flux-pipeline", None, ParallelPlan(tp_size=2), "FP32", "cpu", weights_path=flux_dir, progress=False,
        stream=True, request_timeout_s=120, limits=EngineLimits(max_batch_size=2, max_tokens=600)))
    build_model_version(repository, "wan", BuildRequest(
        "wan-pipeline", None, ParallelPlan(tp_size=3), "FP32", "cpu", weights_path=wan_dir, progress=False,
        request_timeout_s=TIMEOUT_S, limits=EngineLimits(max_batch_size=2, max_tokens=48)))
    server = start_server(repository, root / "server.log")
    yield server, repository, {"flux": flux_dir, "wan": wan_dir}
    server.stop()


def workers(server) -> dict[int, int]:
    """rank -> worker pid of every model (ranks of "flux" as 0-1, of "wan" as 10-12)."""
    found = {}
    for name, pids in rank_workers(server.process.pid).items():
        assert len(pids) == 1, (name, pids)
        found[worker_rank(pids[0]) + (10 if name.startswith("wan/") else 0)] = pids[0]
    return found


def log_of(server) -> str:
    """The server's log so far (the stubs' and workers' lines included)."""
    return server.log_file.read_text(errors="replace")


def flux_image(server, steps: int = 1, **options) -> np.ndarray:
    """An image from "flux" through mdtriton's client (a stream of its own, with the triton_grpc_error header)."""
    return generate(server.grpc_address, "flux", "a cat", **{**FLUX, **options}, num_inference_steps=steps,
                    timeout=120)


def wan_video(server, steps: int = 2, **options) -> np.ndarray:
    """A video from "wan" through mdtriton's client (a unary call)."""
    return generate_video(server.grpc_address, "wan", "a red cat", **{**WAN, **options}, num_inference_steps=steps,
                          timeout=60)


def step_seconds(server, ask=flux_image, steps: int = 10) -> tuple[float, float]:
    """How long a step of a model takes now (this machine's load varies), and the rest of a request: from a request of
    `steps` steps against a 1-step one."""
    start = time.monotonic()
    ask(server, 1)
    one = time.monotonic() - start
    start = time.monotonic()
    ask(server, steps)
    step = max((time.monotonic() - start - one) / (steps - 1), 0.01)
    return step, max(one - step, 0.0)


def failure(call) -> tuple[str, str, float]:
    """(gRPC status, message, seconds) of a call that must fail."""
    start = time.monotonic()
    with pytest.raises((ClientError, InferenceServerException)) as caught:
        call()
    error = caught.value
    if isinstance(error, InferenceServerException):
        return str(error.status()), error.message(), time.monotonic() - start
    status, _, message = str(error).partition(": ")[2].partition(": ")
    return status, message, time.monotonic() - start


def wan_inputs(**changes) -> list[grpcclient.InferInput]:
    """A request to "wan": WAN's values and 2 steps, with changes."""
    options = {**WAN, "num_inference_steps": 2, **changes}
    return video_inputs(["a red cat"], options["height"], options["width"], options["num_frames"],
                        options["num_inference_steps"], options["guidance_scale"], options["seed"],
                        guidance_scale_2=options.get("guidance_scale_2"), loras=options.get("loras"))


def wan_infer(server, timeout: float = 60, **changes):
    """A unary gRPC request to "wan" (tritonclient's own infer)."""
    return grpcclient.InferenceServerClient(server.grpc_address).infer("wan", wan_inputs(**changes),
                                                                       client_timeout=timeout)


def wan_is_right(server, pipelines) -> float:
    """Ask "wan" for a 2-step video, check it against diffusers'; the seconds it took to answer."""
    start = time.monotonic()
    video = wan_video(server, 2)
    seconds = time.monotonic() - start
    expected = reference_video(pipelines["wan"], ["a red cat"], WAN["height"], WAN["width"], WAN["num_frames"], 2,
                               WAN["guidance_scale"], WAN["seed"])
    assert max_level_difference(video, expected) <= 1
    return seconds


def flux_is_right(server, pipelines) -> float:
    """Ask "flux" for a 2-step image, check it against diffusers'; the seconds it took to answer."""
    start = time.monotonic()
    image = flux_image(server, 2)
    seconds = time.monotonic() - start
    expected = reference_image(pipelines["flux"], ["a cat"], FLUX["height"], FLUX["width"], 2, FLUX["guidance_scale"],
                               FLUX["seed"])
    assert max_level_difference(image, expected) <= 1
    return seconds


def add_adapter_file(repository, model: str, name: str, factors: dict[str, Factors]):
    """Keep factors as the model's adapter `name`, as `mdtriton lora add` keeps them; its path."""
    directory = adapters_dir(repository / model)
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.safetensors"
    write_adapter(path, factors)
    return path


def small_adapter(features: int) -> dict[str, Factors]:
    """A rank-4 adapter of FLUX's first block's q projection (features: its width)."""
    generator = torch.Generator().manual_seed(3)
    return {"transformer_blocks.0.attn.to_q": Factors(0.1 * torch.randn(4, features, generator=generator),
                                                       0.1 * torch.randn(features, 4, generator=generator), 1.0)}


@pytest.mark.timeout(300)
def test_requests_the_ranks_cannot_take_are_answered_at_once_and_nothing_heals(served):
    """Refused by the receiving stub before any rank hears of them (INVALID_ARGUMENT), or ended by every rank at the
    same point when an adapter a request names goes before its turn: none restarts a worker."""
    server, repository, pipelines = served
    before = workers(server)
    empty_prompt = video_inputs(["a red cat"], 32, 48, 9, 2, 5.0, 4)
    empty_prompt[0] = grpcclient.InferInput("prompt", [0], "BYTES")
    empty_prompt[0].set_data_from_numpy(np.array([], dtype=np.object_))
    long_prompt = video_inputs(["a" * 70000], 32, 48, 9, 2, 5.0, 4)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    damaged = add_adapter_file(repository, "flux", "damaged", small_adapter(64))
    damaged.write_bytes(damaged.read_bytes()[:len(damaged.read_bytes()) // 2])
    cases = [
        (lambda: wan_infer(server, guidance_scale_2=4.0), "guidance_scale_2 is the guidance of a second expert"),
        (lambda: client.infer("wan", empty_prompt), "prompt has no rows (shape [0]); send at least one"),
        (lambda: client.infer("wan", long_prompt), "prompt[0] is 70000 bytes, over the 65536 taken"),
        (lambda: wan_infer(server, num_frames=2**31 - 1), "num_frames 2147483647 is not 4k+1; send 2147483645 (the"),
        (lambda: flux_image(server, loras={"damaged": 1.0}), "adapter 'damaged' cannot be used"),
        (lambda: flux_image(server, cache="null"), "cache is null, not a JSON object"),
    ]
    slowest = 0.0
    for call, message in cases:
        status, answer, seconds = failure(call)
        assert status in ("INVALID_ARGUMENT", "StatusCode.INVALID_ARGUMENT") and message in answer, (status, answer)
        assert seconds < ANSWERED_WITHIN_S, (answer, seconds)
        slowest = max(slowest, seconds)

    # An adapter removed while its request waits behind another: every rank finds it gone, at the same point.
    gone = add_adapter_file(repository, "flux", "gone", small_adapter(64))
    steps = math.ceil(2.0 / step_seconds(server)[0])
    received = requests_received(server, "flux")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(flux_image, server, steps)
        while requests_received(server, "flux") < received + 1:
            time.sleep(0.05)
        second = pool.submit(failure, lambda: flux_image(server, loras={"gone": 1.0}))
        while requests_received(server, "flux") < received + 2:  # its stub has checked it: the adapter was there
            time.sleep(0.05)
        gone.unlink()
        assert first.result().shape == (1, 48, 64, 3)
        turn = time.monotonic()
        status, answer, _ = second.result()
    print(f"\nrefused by a stub: each within {slowest:.2f} s; the adapter gone before its turn: answered "
          f"{time.monotonic() - turn:.2f} s after the job before it")
    assert status == "INVALID_ARGUMENT" and "no adapter 'gone' in" in answer, (status, answer)
    assert workers(server) == before and "healing" not in log_of(server)
    flux_is_right(server, pipelines)
    wan_is_right(server, pipelines)


def requests_received(server, model: str) -> float:
    """The requests the model's stubs have taken (checked, and handed to their workers), all ranks together."""
    return sum(value for labels, value in scrape(server.metrics_url, "mdtriton_requests_received_total").items()
               if dict(labels)["model"] == model)


@pytest.mark.timeout(300)
def test_a_failure_on_one_rank_before_the_collectives_is_answered_at_once_on_three_ranks(served):
    """Rank 2's worker cannot hold a large adapter's factors (its memory capped) while ranks 0 and 1 load them: every
    rank ends the job where the ranks agree, before the first transformer call; the request is answered INTERNAL
    naming rank 2, no worker restarts, and the same request is answered once the memory is back."""
    server, repository, pipelines = served
    before = workers(server)
    generator = torch.Generator().manual_seed(4)
    features, rank = 72, 60000  # Wan's tiny attention (6 heads of 12); 17 MB per factor
    lora_a = 1e-4 * torch.randn(rank, features, generator=generator)
    lora_b = 1e-4 * torch.randn(features, rank, generator=generator)
    add_adapter_file(repository, "wan", "large", {"blocks.0.attn1.to_q": Factors(lora_a, lora_b, 1.0)})
    with memory_capped(before[12], 8 * 2**20):
        status, answer, seconds = failure(lambda: wan_infer(server, loras={"large": 1.0}))
    print(f"\nrank 2 out of memory before the collectives: {status} after {seconds:.2f} s: {answer}")
    assert status == "StatusCode.INTERNAL" and answer.startswith("rank 2: "), (status, answer)
    assert seconds < ANSWERED_WITHIN_S, seconds
    assert "failed on every rank before its collectives (the ranks serve on): rank 2: " in log_of(server)
    assert workers(server) == before and "healing" not in log_of(server)
    assert wan_infer(server, loras={"large": 1.0}).as_numpy("video").shape == (1, 9, 32, 48, 3)
    wan_is_right(server, pipelines)


@pytest.mark.timeout(300)
def test_requests_past_their_deadline_are_answered_and_dropped_and_no_worker_is_killed(served):
    """Overload, on 3 ranks. Two requests at once, each of 3/4 of the request timeout: the first is answered; the second
    waits for it, starts, passes its deadline and stops after that step. Then two of twice the timeout: the first stops
    at its deadline, the second passes its deadline in the queue and never runs. Each failure is UNAVAILABLE at its
    deadline, saying which; no worker is killed, nothing heals, and the next request is right."""
    server, _, pipelines = served
    before = workers(server)
    step, rest = step_seconds(server, wan_video, 8)
    running = "its job was running, and stops after its next step"
    dropped = "it waited for the ranks, busy with other requests, and was dropped without running"

    def two_at_once(steps: int) -> set[str | None]:
        """The answers to two requests of `steps` steps sent at once: None for an answer, else the failure's reason."""
        def ask(_):
            start = time.monotonic()
            try:
                wan_video(server, steps)
                return None
            except ClientError as error:
                message = str(error)
            seconds = time.monotonic() - start
            print(f"{steps} steps: answered after {seconds:.2f} s: {message}")
            assert f"UNAVAILABLE: no answer from all ranks within {TIMEOUT_S:.0f} s" in message, message
            assert seconds < TIMEOUT_S + 2, message
            return message.rpartition("(request_timeout_s in config.pbtxt): ")[2]

        with ThreadPoolExecutor(2) as pool:
            return set(pool.map(ask, range(2)))

    # Each of 3/4 of the timeout: the second passes its deadline running (the step time is measured on a busy
    # machine: the size is corrected until the first is answered and the second is not).
    steps = math.ceil((0.75 * TIMEOUT_S - rest) / step)
    for _ in range(4):
        seen = two_at_once(steps)
        if seen == {None, running}:
            break
        steps = math.ceil(steps * (1.3 if seen == {None} else 0.7))
    assert seen == {None, running}, (steps, seen)
    assert two_at_once(3 * steps) == {running, dropped}  # each of about twice the timeout
    seconds = wan_is_right(server, pipelines)
    print(f"step {step:.3f} s; the next request: {seconds:.2f} s")
    assert seconds < ANSWERED_WITHIN_S
    log = log_of(server)
    assert re.search(r"stopped after \d+ of \d+ steps: past its deadline", log)
    assert "dropped before it started: past its deadline" in log
    assert workers(server) == before and "healing" not in log and "killing" not in log


@pytest.mark.timeout(300)
def test_a_cancelled_stream_frees_the_ranks_within_a_step(served):
    """A streamed request cancelled by its client (tritonclient's stop_stream(cancel_requests=True)) after its first
    step: the ranks stop it after their next step, the log says how far it got, and the next request waits no more
    than about a step for them."""
    server, _, _ = served
    before = workers(server)
    step, _ = step_seconds(server)
    start = time.monotonic()
    flux_image(server, 1)
    alone = time.monotonic() - start
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("flux", pipeline_inputs(["a cat"], 48, 64, 1000, 3.5, 5))
    result, error = responses.get(timeout=60)
    assert error is None and result.as_numpy("step")[0] == 1
    client.stop_stream(cancel_requests=True)
    start = time.monotonic()
    flux_image(server, 1)
    waited = time.monotonic() - start
    print(f"\nstep {step:.3f} s; a 1-step request alone {alone:.2f} s, after the cancel {waited:.2f} s")
    assert waited < alone + step + 1.0
    match = re.search(r"stopped after (\d+) of 1000 steps: cancelled by its client", log_of(server))
    assert match and int(match.group(1)) < 1000, match
    assert workers(server) == before


@pytest.mark.timeout(300)
def test_a_unary_request_whose_client_timed_out_stops_on_three_ranks(served):
    """tritonclient's client_timeout on a unary call (a gRPC deadline): Triton cancels the request, and the 3 ranks
    stop its job after their next step instead of running its 1000 steps."""
    server, _, pipelines = served
    before = workers(server)
    status, _, _ = failure(lambda: wan_infer(server, num_inference_steps=1000, timeout=1.0))  # (it would take minutes)
    assert status == "StatusCode.DEADLINE_EXCEEDED", status
    seconds = wan_is_right(server, pipelines)
    print(f"\nthe next request after the client's timeout: {seconds:.2f} s")
    assert seconds < ANSWERED_WITHIN_S
    assert re.search(r"stopped after \d+ of 1000 steps: cancelled by its client", log_of(server))
    assert workers(server) == before


@pytest.mark.timeout(300)
def test_a_bad_request_beside_a_good_one_on_one_stream_leaves_the_server_up(served):
    """The case that crashed Triton 2.51 with a stream opened with the `triton_grpc_error: true` header (its own bug:
    docs/client.md). On a stream without it, for the streamed model and for the unary one, the bad request gets its
    message and the good one its answer; with mdtriton's client (the header, one stream per request) both get their
    status. The server stays up."""
    server, _, pipelines = served
    for model, good, bad in (("flux", pipeline_inputs(["a cat"], 48, 64, 30, 3.5, 5),
                              pipeline_inputs(["a cat"], 40, 64, 1, 3.5, 5)),
                             ("wan", wan_inputs(num_inference_steps=12), wan_inputs(height=40))):
        responses = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_address)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, good)
        if model == "flux":
            responses.get(timeout=60)  # its first step: it runs
        else:
            time.sleep(0.3)
        client.async_stream_infer(model, bad)
        errors, answers = [], []
        while not (errors and answers):
            result, error = responses.get(timeout=60)
            if error is not None:
                errors.append(error.message())
            elif "step" not in {output.name for output in result.get_response().outputs}:
                answers.append(result)
        client.stop_stream()
        assert len(errors) == 1 and "height 40 is not a positive multiple of 16" in errors[0], errors
        assert answers[0].as_numpy("image" if model == "flux" else "video").shape[0] == 1
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(flux_image, server, 6)
        status, answer, _ = failure(lambda: flux_image(server, height=40))
        assert good.result().shape == (1, 48, 64, 3)
    assert status == "INVALID_ARGUMENT" and "height 40" in answer
    assert server.process.poll() is None
    flux_is_right(server, pipelines)


@pytest.mark.timeout(120)
def test_a_streamed_model_over_http(served):
    """Triton's /generate_stream (server-sent events) takes a streamed model: a step event per step, then the image;
    /generate and /infer, which take one response, refuse it (docs/client.md)."""
    server, _, _ = served
    url = f"http://{server.http_address}/v2/models/flux"
    body = json.dumps({"prompt": "a cat", "height": 48, "width": 64, "num_inference_steps": 2}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/generate_stream", body), timeout=60) as answer:
        lines = answer.read().splitlines()
    events = [json.loads(line.removeprefix(b"data: ")) for line in lines if line.startswith(b"data: ")]
    assert [event["step"] for event in events[:2]] == [1, 2] and len(events[2]["image"]) == 48 * 64 * 3, events
    with urllib.request.urlopen(urllib.request.Request(url + "/generate", body), timeout=60) as answer:
        # (Triton 2.51 answers this refusal with HTTP status 200.)
        assert "generate expects model to produce exactly 1 response" in json.loads(answer.read())["error"]
    kserve = json.dumps({"inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES", "data": ["a cat"]}]}).encode()
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(urllib.request.Request(url + "/infer", kserve), timeout=60)
    assert caught.value.code == 501 and "decoupled transaction policy" in caught.value.read().decode()


@pytest.mark.timeout(300)
def test_a_request_run_again_after_a_healing_reports_each_step_once(served):
    """Rank 1's worker killed while a streamed request runs: the ranks heal, the request runs again from its start,
    and its client sees each step once, in order (the steps it saw before are not reported again), then the right
    image."""
    server, _, pipelines = served
    steps = max(10, math.ceil(1.0 / step_seconds(server)[0]))
    seen = []
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, server.grpc_address, "flux", "a cat", **FLUX, num_inference_steps=steps,
                             on_step=lambda done, total: seen.append(done), timeout=120)
        while len(seen) < 2:
            time.sleep(0.01)
        os.kill(workers(server)[1], signal.SIGKILL)
        image = answer.result()
    assert seen == list(range(1, steps + 1)), seen
    expected = reference_image(pipelines["flux"], ["a cat"], FLUX["height"], FLUX["width"], steps,
                               FLUX["guidance_scale"], FLUX["seed"])
    assert max_level_difference(image, expected) <= 1
    healed = re.findall(r"healed in ([\d.]+) s", log_of(server))
    print(f"\n{steps} steps, rank 1 killed after step 2: healed in {healed} s")
    assert "healed in" in log_of(server)
