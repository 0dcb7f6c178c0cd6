"""Requests to a Triton server that serves mdtriton models, over gRPC (tritonclient underneath).

One `Client` per server: inference (numpy or torch tensors in, numpy arrays out; one at a time, as
futures, or many at once), the server's health, model metadata and config, the repository index, and
model control (load, unload, serve only some versions). Tensors of SHM_THRESHOLD_BYTES or more travel
through shared memory when the server is on this host (client/shared_memory.py). Every call carries the
server's key where the client finds one (client/server_key.py): shared memory and model control need it.
Requests that find the server or model UNAVAILABLE are retried a few times; every failure ends as a
ClientError whose message is one line.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from tritonclient.utils.shared_memory import SharedMemoryException

from mdtriton.client.server_key import KEY_FILE_ENV, is_local, key_file, key_headers
from mdtriton.client.shared_memory import RegionPool, cuda_shared_memory_available
from mdtriton.client.tensors import NUMPY_TYPES, as_numpy, is_cuda, sendable, to_torch  # noqa: F401 - to_torch: API

log = logging.getLogger("mdtriton.client")

# Tensors this big or bigger go through shared memory (when the server is local). Measured round trips
# (docs/benchmarks.md, "Shared memory vs gRPC messages"): below ~64 KiB both ways cost the same; shared memory was
# ~1.6x faster at 128-256 KiB, ~3x at 1 MiB, ~8x at 64 MiB.
SHM_THRESHOLD_BYTES = 128 << 10
# UNAVAILABLE (server starting, model loading, ranks regrouping) is retried after 0.5 s, 1 s, 2 s, ...
RETRY_FIRST_WAIT_S = 0.5
# Triton's answer to load/unload when it was not started with --model-control-mode explicit.
NO_MODEL_CONTROL = "explicit model load / unload is not allowed"
# Triton's answer to a restricted protocol's request without the key (client/server_key.py).
RESTRICTED = "This protocol is restricted"


class ClientError(Exception):
    """A request that failed; the message is the server's (or ours) in one line."""


def status_of(error: InferenceServerException) -> str:
    """'UNAVAILABLE' from tritonclient's 'StatusCode.UNAVAILABLE'."""
    return (error.status() or "ERROR").removeprefix("StatusCode.")


class Client:
    """A gRPC connection to one Triton server.

    timeout: seconds each call may take (None: no limit). retries: how often a call that finds the
    server or model UNAVAILABLE is tried again. shm_threshold: tensors of this many bytes or more use
    shared memory when the server is on this host (0: all; None: never). concurrency: requests in
    flight at once through infer_async / infer_many.
    """

    def __init__(self, url: str, timeout: float | None = None, retries: int = 2,
                 shm_threshold: int | None = SHM_THRESHOLD_BYTES, concurrency: int = 8):
        self.url = url
        self.timeout = timeout
        self.retries = retries
        self.shm_threshold = shm_threshold if is_local(url) else None
        self.concurrency = concurrency
        # The key of the server's shared-memory and model-repository protocols (client/server_key.py), if known.
        self.headers = key_headers(url)
        self._client = grpcclient.InferenceServerClient(url)
        self._metadata: dict[tuple[str, str], dict] = {}
        self._pools: dict[tuple[str, int], RegionPool] = {}
        self._pools_lock = threading.Lock()
        # Output byte sizes seen for a (model, version, input signature): outputs that big go to shared memory.
        self._output_bytes: dict[tuple, dict[str, int]] = {}
        self._executor: ThreadPoolExecutor | None = None

    # --- the server and its repository -------------------------------------------------------------------

    def health(self) -> dict[str, bool]:
        """{"live": ..., "ready": ...} for the server."""
        return {"live": self._call("health", self._client.is_server_live),
                "ready": self._call("health", self._client.is_server_ready)}

    def server_metadata(self) -> dict:
        """The server's name, version and protocol extensions."""
        return self._call("server metadata", self._client.get_server_metadata, as_json=True)

    def model_ready(self, model: str, version: str = "") -> bool:
        return self._call(f"model {model!r}", self._client.is_model_ready, model, version)

    def repository_index(self) -> list[dict]:
        """Every model (and version) the server's repository holds, with its state: READY, UNAVAILABLE, ..."""
        return self._call("repository index", self._client.get_model_repository_index, as_json=True).get("models", [])

    def load(self, model: str, versions: list[int] | None = None) -> None:
        """Load (or reload) a model from the repository; needs the server's explicit model control mode.

        versions: serve exactly these versions, by loading the model's config with
        version_policy {specific: versions} (an override for this load; config.pbtxt is not changed).
        Versions that were served and are not listed are unloaded; the listed ones keep serving while
        Triton reloads them. Returns once the dropped versions are gone.
        """
        what = f"load {model!r}"
        if not versions:
            self._call(what, self._client.load_model, model)
        else:
            if not any(entry.get("state") == "READY" for entry in self._versions_of(model)):
                self._call(what, self._client.load_model, model)
            config = self.model_config(model)
            config["version_policy"] = {"specific": {"versions": sorted(int(v) for v in versions)}}
            self._call(what, self._client.load_model, model, config=json.dumps(config))
            self._wait_unloaded(model, keep={str(v) for v in versions})
        self._metadata.clear()

    def unload(self, model: str) -> None:
        """Unload every version of a model (explicit model control mode); returns once they are gone."""
        self._call(f"unload {model!r}", self._client.unload_model, model)
        self._wait_unloaded(model, keep=set())
        self._metadata.clear()

    def _versions_of(self, model: str) -> list[dict]:
        return [entry for entry in self.repository_index() if entry["name"] == model and entry.get("version")]

    def _wait_unloaded(self, model: str, keep: set[str]) -> None:
        """Triton unloads in the background: wait until no version outside keep is READY or UNLOADING."""
        deadline = time.monotonic() + (self.timeout or 120.0)
        while True:
            busy = [entry["version"] for entry in self._versions_of(model)
                    if entry["version"] not in keep and entry.get("state") in ("READY", "UNLOADING")]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise ClientError(f"unload {model!r}: versions {busy} were still loaded after "
                                  f"{self.timeout or 120.0:.0f} s; see the server log")
            time.sleep(0.2)

    # --- one model -------------------------------------------------------------------------------------

    def metadata(self, model: str, version: str = "") -> dict:
        """The model's metadata as Triton gives it: name, versions, platform, inputs, outputs."""
        key = (model, version)
        if key not in self._metadata:
            self._metadata[key] = self._call(f"model {model!r}", self._client.get_model_metadata, model,
                                             version, as_json=True)
        return self._metadata[key]

    def model_config(self, model: str, version: str = "") -> dict:
        """The model's config as the server loaded it (config.pbtxt, completed by Triton), as JSON."""
        return self._call(f"model {model!r}", self._client.get_model_config, model, version,
                          as_json=True)["config"]

    def infer(self, model: str, inputs: dict, version: str = "", timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run the model on inputs (name -> numpy array, torch tensor, or anything np.asarray takes);
        return its outputs as numpy arrays (BF16 as ml_dtypes.bfloat16).

        Each input is converted to the data type the model declares (e.g. float32 -> BF16).
        """
        metadata = self.metadata(model, version)
        declared = {spec["name"]: spec["datatype"] for spec in metadata["inputs"]}
        unknown = sorted(set(inputs) - set(declared))
        if unknown:
            raise ClientError(f"model {model!r} has no input(s) {unknown}; its inputs are {sorted(declared)}")
        lent: list[tuple[RegionPool, object]] = []
        try:
            infer_inputs, signature, cuda_device = self._infer_inputs(inputs, declared, lent)
            key = (model, version, signature)
            outputs, output_regions = self._requested_outputs(metadata, self._output_bytes.get(key, {}),
                                                              cuda_device, lent)
            result = self._call(f"infer {model!r}" + (f" version {version}" if version else ""), self._client.infer,
                                model, infer_inputs, model_version=version, outputs=outputs,
                                client_timeout=timeout or self.timeout)
            return self._read_outputs(result, key, output_regions)
        finally:
            for pool, region in lent:
                pool.give_back(region)

    def infer_async(self, model: str, inputs: dict, version: str = "", timeout: float | None = None) -> Future:
        """infer() in the client's pool of `concurrency` threads; the future holds the outputs.

        From asyncio: `await asyncio.wrap_future(client.infer_async(...))`.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="mdtriton-client")
        return self._executor.submit(self.infer, model, inputs, version, timeout)

    def infer_many(self, model: str, many_inputs: list[dict], version: str = "",
                   timeout: float | None = None) -> list[dict[str, np.ndarray]]:
        """Send every request, up to `concurrency` at once; the outputs come back in the order of the inputs."""
        futures = [self.infer_async(model, inputs, version, timeout) for inputs in many_inputs]
        return [future.result() for future in futures]

    # --- how tensors travel --------------------------------------------------------------------------

    def _infer_inputs(self, inputs: dict, declared: dict[str, str], lent: list) -> tuple[list, tuple, int | None]:
        """InferInputs (bytes in the message, or a shared memory region), the request's input signature,
        and the GPU whose CUDA shared memory took inputs (None if none did)."""
        infer_inputs, signature, cuda_device = [], [], None
        for name, value in inputs.items():
            datatype = declared[name]
            value = sendable(value, datatype)
            if is_cuda(value) and (self.shm_threshold is None or not cuda_shared_memory_available()):
                value = as_numpy(value)  # through the host: CUDA shared memory is off or needs cuda-python
            gpu = value.device.index if is_cuda(value) else None
            infer_input = grpcclient.InferInput(name, list(value.shape), datatype)
            loan = self._lend(value.nbytes, gpu, lent)
            if loan is not None:
                pool, region = loan
                pool.write(region, value)
                infer_input.set_shared_memory(region.name, value.nbytes)
                cuda_device = gpu if gpu is not None else cuda_device
            else:
                infer_input.set_data_from_numpy(as_numpy(value))
            infer_inputs.append(infer_input)
            signature.append((name, datatype, tuple(value.shape)))
        return infer_inputs, tuple(signature), cuda_device

    def _requested_outputs(self, metadata: dict, output_bytes: dict[str, int], cuda_device: int | None,
                           lent: list) -> tuple[list | None, dict]:
        """Outputs known (from an earlier request of the same shapes) to be big get a shared memory region;
        None when every output comes back in the message."""
        requested, regions = [], {}
        for spec in metadata["outputs"]:
            output = grpcclient.InferRequestedOutput(spec["name"])
            nbytes = output_bytes.get(spec["name"])
            loan = self._lend(nbytes, cuda_device, lent) if nbytes is not None else None
            if loan is not None:
                output.set_shared_memory(loan[1].name, loan[1].byte_size)
                regions[spec["name"]] = loan
            requested.append(output)
        return (requested if regions else None), regions

    def _read_outputs(self, result, key: tuple, output_regions: dict) -> dict[str, np.ndarray]:
        outputs, sizes = {}, {}
        for output in result.get_response().outputs:
            dtype = NUMPY_TYPES[output.datatype]
            shape = list(output.shape)
            if output.name in output_regions:
                pool, region = output_regions[output.name]
                outputs[output.name] = pool.read(region, dtype, shape)
            else:
                outputs[output.name] = result.as_numpy(output.name)
            sizes[output.name] = math.prod(shape) * dtype.itemsize
        self._output_bytes[key] = sizes
        return outputs

    def _lend(self, nbytes: int, cuda_device: int | None, lent: list):
        """(pool, region) for a tensor of nbytes if it should use shared memory, else None.

        If the server cannot map our memory (another host or container behind a loopback address),
        shared memory is switched off for this client, with a warning, and bytes go in the message.
        """
        if self.shm_threshold is None or nbytes < self.shm_threshold:
            return None
        key = ("cuda", cuda_device) if cuda_device is not None else ("system", 0)
        with self._pools_lock:
            pool = self._pools.get(key) or self._pools.setdefault(key, RegionPool(self._client, *key, self.headers))
        try:
            region = pool.take(nbytes)
        except (InferenceServerException, SharedMemoryException) as error:
            log.warning("shared memory with %s does not work (%s); sending tensors in gRPC messages instead",
                        self.url, error)
            self.shm_threshold = None
            return None
        lent.append((pool, region))
        return pool, region

    def _call(self, what: str, method, *args, **kwargs):
        """method(*args, **kwargs) with the server's key, retried on UNAVAILABLE; its failure as a one-line
        ClientError."""
        for attempt in range(self.retries + 1):
            try:
                return method(*args, headers=self.headers, **kwargs)
            except InferenceServerException as error:
                status = status_of(error)
                if (status == "UNAVAILABLE" and attempt < self.retries
                        and not any(text in str(error.message()) for text in (NO_MODEL_CONTROL, RESTRICTED))):
                    time.sleep(RETRY_FIRST_WAIT_S * 2**attempt)
                    continue
                raise ClientError(self._message(what, status, error, kwargs.get("client_timeout"))) from None

    def _message(self, what: str, status: str, error: InferenceServerException, timeout: float | None) -> str:
        text = " ".join(str(error.message()).split())
        if status == "UNAVAILABLE" and ("failed to connect" in text or "Connection refused" in text):
            return f"{what}: no Triton server answers at {self.url} (UNAVAILABLE: {text})"
        if RESTRICTED in text:
            port = urlsplit(f"//{self.url}").port
            return (f"{what}: the server takes this only from clients that hold its key ({status}: {text}); on the "
                    f"server's host, as its user, set {KEY_FILE_ENV} to the file holding the key (an mdtriton server "
                    f"on port {port} writes it to {key_file(port) if port else 'its key directory'})")
        if NO_MODEL_CONTROL in text:
            return f"{what}: the server takes no load/unload requests; start it with --model-control-mode explicit"
        if status == "DEADLINE_EXCEEDED":
            return f"{what}: no answer within {timeout} s (DEADLINE_EXCEEDED); raise the timeout or check the server"
        return f"{what}: {status}: {text}"

    def close(self) -> None:
        """Finish the requests in flight, free every shared memory region, close the connection."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._client.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
