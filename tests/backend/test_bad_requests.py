"""Bad requests, table-driven, against a real tritonserver serving a tiny transformer (tp 2) and a FLUX
transformer (cp 2, ring): each gets the right gRPC status and a one-line message saying what to fix, the
request never reaches the other ranks (no epoch ends), and the next good request is answered right."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.build_tools.engine_builder import random_weights, reference_module
from mdtriton.engine.manifest import EngineLimits
from mdtriton.engine.plan import ParallelPlan
from mdtriton.families.flux import FLUX
from tests.backend.load_clients import CONFIG as TINY_CONFIG
from tests.backend.load_clients import Clients, Reference, send
from mdtriton.testing.metrics import scrape, settled
from tests.conftest import start_server
from tests.engine.flux_cases import flux_inputs

FLUX_CONFIG = FLUX.default_config()
LIMITS = EngineLimits(max_batch_size=4, max_tokens=64)
INVALID = "StatusCode.INVALID_ARGUMENT"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    build_model_version(repository, "tiny", BuildRequest(
        "tiny_transformer", TINY_CONFIG, ParallelPlan(tp_size=2), "FP32", "cpu", seed=2, limits=LIMITS, progress=False))
    build_model_version(repository, "flux", BuildRequest(
        "flux", FLUX_CONFIG, ParallelPlan(cp_size=2, cp_method="ring"), "FP32", "cpu", seed=3, limits=LIMITS,
        progress=False))
    log_file = repository.parent / "server.log"
    server = start_server(repository, log_file)
    yield server, log_file
    server.stop()


def tiny_good() -> dict[str, np.ndarray]:
    return {"hidden_states": np.random.default_rng(0).standard_normal((2, 5, 64), dtype=np.float32)}


def flux_good() -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in flux_inputs(FLUX_CONFIG, text_len=6, image_len=10, batch=2, seed=1).items()}


def expected(model: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    architecture, config, seed, output = {"tiny": ("tiny_transformer", TINY_CONFIG, 2, "output"),
                                          "flux": ("flux", FLUX_CONFIG, 3, "sample")}[model]
    module = reference_module(architecture, config, random_weights(architecture, config, seed), "FP32")
    with torch.inference_mode():
        return module(**{name: torch.from_numpy(a) for name, a in inputs.items()})[output].numpy()


def changed(inputs: dict[str, np.ndarray], **changes) -> dict[str, np.ndarray]:
    """inputs with some replaced (a None value removes that input)."""
    return {name: a for name, a in {**inputs, **changes}.items() if a is not None}


def with_value(array: np.ndarray, value: float) -> np.ndarray:
    array = array.copy()
    array.flat[3] = value
    return array


@dataclass
class Bad:
    name: str
    model: str
    inputs: dict  # name -> array (sent with the Triton type of its numpy dtype)
    status: str
    message: str  # a part of the answer's message
    version: str = ""
    byte_size: int | None = None  # send this many bytes of data for the first input instead of its own


TINY, FLUX = tiny_good(), flux_good()
CASES = [
    Bad("wrong dtype (INT64)", "tiny", {"hidden_states": TINY["hidden_states"].astype(np.int64)}, INVALID,
        "data-type is 'INT64', but model 'tiny' expects 'FP32'"),
    Bad("wrong dtype (FP16)", "tiny", {"hidden_states": TINY["hidden_states"].astype(np.float16)}, INVALID,
        "data-type is 'FP16', but model 'tiny' expects 'FP32'"),
    Bad("too few dimensions", "tiny", {"hidden_states": TINY["hidden_states"][0]}, INVALID, "unexpected shape"),
    Bad("too many dimensions", "tiny", {"hidden_states": TINY["hidden_states"][None]}, INVALID, "unexpected shape"),
    Bad("wrong hidden size", "tiny", {"hidden_states": TINY["hidden_states"][..., :32]}, INVALID, "unexpected shape"),
    Bad("empty batch", "tiny", {"hidden_states": TINY["hidden_states"][:0]}, INVALID, "is empty"),
    Bad("empty sequence", "tiny", {"hidden_states": TINY["hidden_states"][:, :0]}, INVALID, "is empty"),
    Bad("NaN", "tiny", {"hidden_states": with_value(TINY["hidden_states"], np.nan)}, INVALID, "1 NaN or infinite"),
    Bad("infinity", "tiny", {"hidden_states": with_value(TINY["hidden_states"], -np.inf)}, INVALID,
        "1 NaN or infinite"),
    Bad("sequence over the maximum", "tiny", {"hidden_states": np.zeros((1, 65, 64), np.float32)}, INVALID,
        "65 tokens, over this engine's maximum of 64"),
    Bad("batch over the maximum", "tiny", {"hidden_states": np.zeros((5, 4, 64), np.float32)}, INVALID,
        "batch size 5 is over this engine's maximum of 4"),
    Bad("oversized payload (100000 tokens)", "tiny", {"hidden_states": np.zeros((1, 100000, 64), np.float32)},
        INVALID, "100000 tokens, over this engine's maximum of 64"),
    Bad("data shorter than its shape", "tiny", TINY, INVALID, "byte size mismatch", byte_size=100),
    Bad("unknown input", "tiny", {**TINY, "mask": np.zeros((2, 5), np.float32)}, INVALID,
        "Got input(s) ['mask'"),
    Bad("missing input", "tiny", {}, INVALID, "missing required input(s) ['hidden_states']"),
    Bad("unknown model", "no_such_model", TINY, "StatusCode.NOT_FOUND", "unknown model: 'no_such_model'"),
    Bad("unknown version", "tiny", TINY, "StatusCode.NOT_FOUND", "'tiny' version 7 is not found", version="7"),
    Bad("FLUX: batch of encoder_hidden_states", "flux",
        changed(FLUX, encoder_hidden_states=FLUX["encoder_hidden_states"][:1]), INVALID,
        "encoder_hidden_states has batch size 1 but hidden_states has 2"),
    Bad("FLUX: batch of pooled_projections", "flux",
        changed(FLUX, pooled_projections=np.concatenate([FLUX["pooled_projections"]] * 2)), INVALID,
        "pooled_projections has batch size 4 but hidden_states has 2"),
    Bad("FLUX: batch of timestep", "flux", changed(FLUX, timestep=FLUX["timestep"][:1]), INVALID,
        "timestep has batch size 1"),
    Bad("FLUX: batch of guidance", "flux", changed(FLUX, guidance=np.ones(3, np.float32)), INVALID,
        "guidance has batch size 3"),
    Bad("FLUX: img_ids rows != image tokens", "flux", changed(FLUX, img_ids=FLUX["img_ids"][:7]), INVALID,
        "img_ids has 7 rows but hidden_states has 10 image tokens"),
    Bad("FLUX: txt_ids rows != text tokens", "flux", changed(FLUX, txt_ids=np.zeros((9, 3), np.float32)), INVALID,
        "txt_ids has 9 rows but encoder_hidden_states has 6 text tokens"),
    Bad("FLUX: position ids with 2 axes", "flux", changed(FLUX, img_ids=FLUX["img_ids"][:, :2]), INVALID,
        "unexpected shape"),
    Bad("FLUX: text + image over the maximum", "flux",
        changed(FLUX, hidden_states=np.zeros((2, 60, 8), np.float32), img_ids=np.zeros((60, 3), np.float32)),
        INVALID, "66 tokens, over this engine's maximum of 64"),
    Bad("FLUX: NaN timestep", "flux", changed(FLUX, timestep=np.array([0.5, np.nan], np.float32)), INVALID,
        "input 'timestep' holds 1 NaN"),
    Bad("FLUX: missing guidance", "flux", changed(FLUX, guidance=None), INVALID, "missing required input(s) ['guidance']"),
    Bad("FLUX: txt_ids as INT32", "flux", changed(FLUX, txt_ids=FLUX["txt_ids"].astype(np.int32)), INVALID,
        "data-type is 'INT32', but model 'flux' expects 'FP32'"),
]
TRITON_TYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", np.dtype(np.int64): "INT64",
                np.dtype(np.int32): "INT32"}


def infer(server, model: str, inputs: dict[str, np.ndarray], version: str = "", byte_size: int | None = None):
    client = grpcclient.InferenceServerClient(server.grpc_address)
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), TRITON_TYPES[array.dtype])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    if byte_size is not None:
        tensors[0]._raw_content = tensors[0]._raw_content[:byte_size]
    return client.infer(model, tensors, model_version=version, client_timeout=120)


@pytest.mark.timeout(300)
def test_bad_requests_get_clear_errors_and_the_next_good_request_is_right(served):
    server, log_file = served
    good = {"tiny": (TINY, expected("tiny", TINY), "output"), "flux": (FLUX, expected("flux", FLUX), "sample")}
    report = []
    for case in CASES:
        with pytest.raises(InferenceServerException) as caught:
            infer(server, case.model, case.inputs, case.version, case.byte_size)
        status, message = str(caught.value.status()), caught.value.message()
        report.append(f"{case.name}: {status} {message}")
        assert status == case.status, report[-1]
        assert case.message in message and "\n" not in message and "Traceback" not in message, report[-1]
        inputs, reference, output = good["flux" if case.model == "flux" else "tiny"]
        answer = infer(server, "flux" if case.model == "flux" else "tiny", inputs).as_numpy(output)
        assert np.abs(answer - reference).max() < 1e-4, f"wrong answer after {case.name}"
    print("\n".join(report))
    assert len(CASES) >= 20
    assert "epoch 1 ended" not in log_file.read_text()  # no bad request disturbed the ranks' job order


@pytest.mark.timeout(300)
def test_nan_requests_among_good_ones_are_refused_before_any_job(served):
    """The receiving rank's worker refuses NaN and infinity (on its device's copy of the inputs) before the job hub
    orders a job: no rank runs one for them, no epoch ends, and the good requests streaming beside them are
    all answered right."""
    server, log_file = served
    jobs_before = settled(server.metrics_url, "mdtriton_jobs_total")
    clients = Clients(server.grpc_address, "tiny", Reference(2), count=2).start()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    refused = []
    for index in range(10):
        array = with_value(TINY["hidden_states"], [np.nan, np.inf][index % 2])
        refused.append(send(client, "tiny", array)[0])
    outcomes = clients.stop()

    assert all(o.status == INVALID and "1 NaN or infinite value(s); send finite numbers" in o.message
               for o in refused), refused
    assert outcomes and all(o.status is None and o.right for o in outcomes), outcomes
    deadline = time.monotonic() + 10  # each rank reports a job's time just after its answer
    while True:
        jobs = {labels: value - jobs_before[labels] for labels, value
                in scrape(server.metrics_url, "mdtriton_jobs_total").items() if dict(labels)["model"] == "tiny"}
        if set(jobs.values()) == {len(outcomes)} or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(jobs) == 2 and set(jobs.values()) == {len(outcomes)}, (jobs, len(outcomes))  # good requests only
    assert "epoch 1 ended" not in log_file.read_text() and "healing" not in log_file.read_text()
