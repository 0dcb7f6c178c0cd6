"""What serving adds to a FLUX forward, where that time goes, and how long a healing takes.

Builds a FLUX engine into a model repository, serves it with the embedded Triton server and measures:

1. one client's sequential requests (the client connects once, as clients do), the tensors travelling three ways:
   in the gRPC messages; through system shared memory (the client's default when the server is on this host); and,
   with a GPU and cuda-python, from inputs in GPU memory through CUDA shared memory;
2. where a request's time goes (system shared memory): the rank worker's job (backend/job_timer.py, read from
   the rank's Prometheus counters: the forward, the outputs ready; and how much of it the collectives took, by
   CUDA events around each on GPUs), the request's wait in the worker before its job began (the inputs' copy to
   the device and their check for NaN/infinity, the job hub's ordering; the same counters), the stub around them
   (Triton's compute_infer statistic less both: the request check, the hop to the worker and back, the response),
   Triton's own steps (queue, compute_input, compute_output) and the rest (the client and gRPC);
3. --concurrency clients at once: p50 / p99 latency and requests per second;
4. a healing: SIGKILL of rank 0's worker while serving; the time until a request is answered again (the answer must
   equal the one before the kill);

then stops the server, loads the same engine in one process per rank (on GPUs compiling from the cache the
server's load left in the engine directory) and times `engine.forward` alone: the baseline of "overhead".
Progress lines carry the seconds since the start; the tables are printed and written as JSON (--output), the
server's log beside it.

On GPUs (FLUX.1-dev, 4,096 + 512 tokens, 1 GPU; about 6 minutes, building 23.8 GB of random weights on the GPU
included):

    python benchmarks/serving.py --requests 10

On CPU ranks (--tiny: FLUX.1-dev's input and output sizes, bf16, with no transformer blocks and a width of 16, so
the compute is small and the serving path is what is measured; about 1 minute on 2 cores):

    python benchmarks/serving.py --tiny --requests 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mdtriton.build_tools.build import build_model_version
from mdtriton.build_tools.build_request import BuildRequest
from mdtriton.client.grpc_client import Client, ClientError
from mdtriton.client.shared_memory import cuda_shared_memory_available
from mdtriton.engine.comm import Communicator
from mdtriton.engine.engine import TorchEngine
from mdtriton.engine.manifest import Manifest
from mdtriton.engine.plan import CP_METHODS, ParallelPlan
from mdtriton.families.flux import FLUX
from mdtriton.families.flux.transformer import FLUX_DEV_CONFIG, example_inputs
from mdtriton.harness import init_rank, markdown_table, run_ranks, started_server, time_calls
from mdtriton.server import TritonServer
from mdtriton.testing.metrics import scrape_all
from mdtriton.testing.triton_processes import rank_workers, worker_rank

MODEL = "flux"
# FLUX.1-dev's inputs and outputs, with no blocks and a width of 16: the embedders and the output projection read
# and write the real tensors, and compute little (a block's attention over 4,608 tokens alone takes ~0.5 s in bf16 on
# a CPU core).
TINY_CONFIG = {**FLUX_DEV_CONFIG, "num_layers": 0, "num_single_layers": 0, "num_attention_heads": 1,
               "attention_head_dim": 16, "axes_dims_rope": [4, 6, 6]}
STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", flush=True)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def sequential_latencies(client: Client, inputs: dict, warmup: int, requests: int) -> tuple[list[float], dict]:
    """Milliseconds of each of one client's timed requests, after warmup untimed ones; and the last answer."""
    for _ in range(warmup):
        client.infer(MODEL, inputs)
    latencies = []
    for _ in range(requests):
        start = time.perf_counter()
        answer = client.infer(MODEL, inputs)
        latencies.append((time.perf_counter() - start) * 1000)
    return latencies, answer


def concurrent_latencies(address: str, inputs: dict, requests: int, concurrency: int) -> tuple[list[float], float]:
    """Milliseconds of each request sent by `concurrency` clients at once (one connection each), and requests/s."""
    clients = [Client(address, timeout=600) for _ in range(concurrency)]
    try:
        for client in clients:
            client.infer(MODEL, inputs)  # connects, registers its shared memory, learns the output size

        def ask(index: int) -> float:
            start = time.perf_counter()
            clients[index % concurrency].infer(MODEL, inputs)
            return (time.perf_counter() - start) * 1000

        began = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            latencies = list(pool.map(ask, range(requests)))
        return latencies, requests / (time.perf_counter() - began)
    finally:
        for client in clients:
            client.close()


def triton_statistics(client: Client) -> dict[str, tuple[int, int]]:
    """Triton's cumulative statistics of the model: step -> (count, nanoseconds)."""
    statistics_ = client._client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]["inference_stats"]
    return {step: (int(value.get("count", 0)), int(value.get("ns", 0))) for step, value in statistics_.items()}


def one_ranks_counters(server: TritonServer, rank: int = 0) -> dict[str, float]:
    """This rank's mdtriton counters of the model from Triton's metrics endpoint (backend/metrics.py): family ->
    value."""
    mine = {("rank", str(rank)), ("model", MODEL)}
    return {name: value for name, samples in scrape_all(server.metrics_url).items() if name.startswith("mdtriton_")
            for labels, value in samples.items() if mine <= set(labels)}


def mean_ms(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], step: str) -> float:
    count = after[step][0] - before[step][0]
    return (after[step][1] - before[step][1]) / max(count, 1) / 1e6


def time_split(server: TritonServer, inputs: dict, warmup: int, requests: int) -> dict:
    """One client's sequential requests through system shared memory, and where their time went (mean ms)."""
    with Client(server.grpc_address, timeout=600) as client:
        for _ in range(warmup):
            client.infer(MODEL, inputs)
        # The stub records its worker's job times once the worker has been quiet for 0.2 s: let the warm-up's in.
        time.sleep(0.5)
        triton_before, ranks_before = triton_statistics(client), one_ranks_counters(server)
        latencies, _ = sequential_latencies(client, inputs, 0, requests)
        # Wait until the counters hold every job.
        deadline = time.monotonic() + 10
        while True:
            triton_after, ranks_after = triton_statistics(client), one_ranks_counters(server)
            jobs = ranks_after["mdtriton_jobs_total"] - ranks_before["mdtriton_jobs_total"]
            if jobs >= requests or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    job_seconds = sum(ranks_after[name] - ranks_before[name] for name in
                      ("mdtriton_compute_seconds_total", "mdtriton_communication_seconds_total"))
    job_ms = job_seconds / max(jobs, 1) * 1000
    communication_ms = (ranks_after["mdtriton_communication_seconds_total"]
                        - ranks_before["mdtriton_communication_seconds_total"]) / max(jobs, 1) * 1000
    wait_ms = (ranks_after["mdtriton_wait_seconds_total"] - ranks_before["mdtriton_wait_seconds_total"]) / max(jobs, 1) * 1000
    infer_ms = mean_ms(triton_before, triton_after, "compute_infer")
    triton_ms = sum(mean_ms(triton_before, triton_after, step) for step in ("queue", "compute_input", "compute_output"))
    served_ms = statistics.mean(latencies)
    return {"served_mean_ms": served_ms, "worker_job_ms": job_ms, "worker_communication_ms": communication_ms,
            "worker_wait_ms": wait_ms,
            "stub_beyond_job_ms": infer_ms - job_ms - wait_ms,
            "triton_ms": triton_ms, "client_and_grpc_ms": served_ms - infer_ms - triton_ms, "jobs_counted": jobs}


def rank_worker_pid(server: TritonServer, rank: int) -> int:
    """The pid of rank's worker process (a grandchild of the server: server -> stub -> worker)."""
    for pids in rank_workers(server.process.pid).values():
        for pid in pids:
            if worker_rank(pid) == rank:
                return pid
    raise RuntimeError(f"no worker of rank {rank} under tritonserver (pid {server.process.pid})")


def heal(server: TritonServer, inputs: dict, timeout: float) -> dict:
    """SIGKILL rank 0's worker while serving; seconds until a request is answered again (giving up after timeout
    seconds), and whether that answer equals the one before the kill."""
    with Client(server.grpc_address, timeout=600, retries=0) as client:
        before = client.infer(MODEL, inputs)["sample"]
        victim = rank_worker_pid(server, 0)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        progress(f"killed rank 0's worker (pid {victim}); asking until the model answers again")
        failures = 0
        while True:
            try:
                after = client.infer(MODEL, inputs)["sample"]
                break
            except ClientError as error:  # a request that waited longer than request_timeout_s for the ranks
                failures += 1
                progress(f"a request failed while healing ({error}); asking again")
                if time.monotonic() - killed > timeout:
                    return {"heal_failed_requests": failures, "heal_error": str(error)}
        healed = time.monotonic() - killed
    same = before.dtype == after.dtype and np.array_equal(before.view(np.uint8), after.view(np.uint8))
    return {"heal_s": healed, "heal_failed_requests": failures, "heal_same_answer": bool(same)}


def _engine_rank(rank: int, world_size: int, port: int, engine_dir: str, inputs: dict, args, result_path: str) -> None:
    cuda = not args.tiny
    if not cuda:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))  # as a served CPU rank
    device = init_rank(rank, world_size, port, cuda)
    manifest = Manifest.read(engine_dir)
    comm = Communicator(manifest.plan, rank, device)
    comm.join_groups()
    engine = TorchEngine.load(engine_dir, manifest, FLUX, comm)
    on_device = {name: tensor.to(device) for name, tensor in inputs.items()}
    times, _ = time_calls(lambda: engine.forward(on_device), cuda, args.warmup, args.requests)
    if rank == 0:
        Path(result_path).write_text(json.dumps({"times": times, "load_s": engine.load_seconds,
                                                 "warm_up_s": engine.warm_up_seconds}))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU ranks, FLUX.1-dev's input/output sizes, no blocks, width 16")
    parser.add_argument("--preset", default="flux.1-dev", choices=sorted(FLUX.presets()), help="GPU runs' model")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-method", default="allgather_kv", choices=CP_METHODS)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=10, help="timed requests per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4, help="clients at once in the throughput run")
    parser.add_argument("--no-heal", dest="heal", action="store_false", help="skip the healing measurement")
    parser.add_argument("--heal-timeout", type=float, default=240.0, help="seconds to wait for the healed model")
    parser.add_argument("--repository", type=Path, help="model repository to build into (default: a temporary one)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/serving.json"))
    args = parser.parse_args()

    plan = ParallelPlan(args.tp, args.cp, args.cp_method)
    config = TINY_CONFIG if args.tiny else FLUX.presets()[args.preset]
    cuda = not args.tiny
    inputs = example_inputs(config, args.text_tokens, args.image_tokens, torch.bfloat16)
    rows = {"plan": str(plan), "device": "cpu" if args.tiny else torch.cuda.get_device_name(0),
            "model": "tiny (FLUX.1-dev inputs/outputs, no blocks, width 16)" if args.tiny else args.preset,
            "image_tokens": args.image_tokens, "text_tokens": args.text_tokens, "requests": args.requests}
    with tempfile.TemporaryDirectory() as scratch:
        repository = args.repository or Path(scratch)
        log_file = args.output.parent / f"{args.output.stem}-server.log"  # kept beside the results
        args.output.parent.mkdir(parents=True, exist_ok=True)
        log_file.unlink(missing_ok=True)
        progress(f"building {rows['model']} ({plan}, BF16) into {repository}")
        start = time.perf_counter()
        version_dir = build_model_version(repository, MODEL, BuildRequest(
            "flux", config, plan, "BF16", "gpu" if cuda else "cpu", random_device="cuda" if cuda else "cpu",
            progress=False))
        rows["build_s"] = time.perf_counter() - start
        if cuda:
            torch.cuda.empty_cache()  # the ranks need the memory the build's generator used
        progress(f"built in {rows['build_s']:.0f} s; starting the server")
        with started_server(repository, log_file) as (server, ready_s):
            rows["server_start_to_ready_s"] = ready_s
            progress(f"ready in {rows['server_start_to_ready_s']:.0f} s; sequential requests, gRPC messages")
            with Client(server.grpc_address, timeout=600, shm_threshold=None) as client:
                plain, reference = sequential_latencies(client, inputs, args.warmup, args.requests)
            rows["grpc_messages_median_ms"] = statistics.median(plain)
            progress(f"gRPC messages: median {rows['grpc_messages_median_ms']:.1f} ms; system shared memory, split")
            rows.update(time_split(server, inputs, args.warmup, args.requests))
            with Client(server.grpc_address, timeout=600) as client:
                shared, answer = sequential_latencies(client, inputs, 0, args.requests)
            rows["system_shm_median_ms"] = statistics.median(shared)
            rows["same_answer_every_way"] = bool(np.array_equal(answer["sample"].view(np.uint8),
                                                                reference["sample"].view(np.uint8)))
            progress(f"system shared memory: median {rows['system_shm_median_ms']:.1f} ms")
            if cuda and cuda_shared_memory_available():
                on_gpu = {name: tensor.cuda() for name, tensor in inputs.items()}
                with Client(server.grpc_address, timeout=600) as client:
                    latencies, _ = sequential_latencies(client, on_gpu, args.warmup, args.requests)
                    worked = client.shm_threshold is not None  # the client turns shared memory off if it fails
                if worked:
                    rows["cuda_shm_median_ms"] = statistics.median(latencies)
                    progress(f"CUDA shared memory: median {rows['cuda_shm_median_ms']:.1f} ms")
                else:
                    progress("CUDA shared memory did not work (the client's warning above says why)")
            progress(f"{args.concurrency} clients at once")
            concurrent, throughput = concurrent_latencies(server.grpc_address, inputs, 2 * args.requests,
                                                          args.concurrency)
            rows.update({"concurrency": args.concurrency, "concurrent_p50_ms": percentile(concurrent, 0.5),
                         "concurrent_p99_ms": percentile(concurrent, 0.99), "throughput_per_s": throughput})
            if args.heal:
                rows.update(heal(server, inputs, args.heal_timeout))
                progress(f"healed: answered again {rows['heal_s']:.1f} s after the kill (same answer: "
                         f"{rows['heal_same_answer']})" if "heal_s" in rows else
                         f"NOT healed within {args.heal_timeout:.0f} s: {rows['heal_error']}; see {log_file}")
            progress("stopping the server")
        progress("the engine alone, one process per rank")
        result_path = Path(scratch) / "engine.json"
        problem = run_ranks(_engine_rank, plan.world_size,
                            (str(version_dir / "engine"), inputs, args, str(result_path)))
        if problem:
            raise RuntimeError(problem)
        direct = json.loads(result_path.read_text())
    rows.update({"engine_median_ms": statistics.median(direct["times"]), "cached_load_s": direct["load_s"],
                 "cached_warm_up_s": direct["warm_up_s"]})
    report(rows)
    args.output.write_text(json.dumps(rows, indent=1))
    progress(f"written to {args.output}; the server's log to {log_file}")


def report(rows: dict) -> None:
    engine = rows["engine_median_ms"]

    def over(ms: float) -> str:
        return f"{ms:.1f} ({ms - engine:+.1f} ms, {100 * (ms / engine - 1):+.1f}%)"

    cuda_shm = over(rows["cuda_shm_median_ms"]) if "cuda_shm_median_ms" in rows else "not measured"
    print(f"\n{rows['model']}, {rows['plan']}, {rows['image_tokens']:,}+{rows['text_tokens']} tokens, {rows['device']}; "
          f"medians of {rows['requests']} sequential requests\n")
    print(markdown_table(["engine alone ms", "served, system shm ms (overhead)", "served, gRPC messages ms",
                          "served, CUDA shm ms"],
                         [[f"{engine:.1f}", over(rows["system_shm_median_ms"]), over(rows["grpc_messages_median_ms"]),
                           cuda_shm]]))
    print(f"\nWhere a request's time goes (system shm, means of {rows['requests']}: {rows['served_mean_ms']:.1f} ms):\n")
    print(markdown_table(["rank worker's job (forward, outputs)", "of it in collectives",
                          "in the worker before the job (input copy and check, job order)",
                          "stub beyond those (shape check, hop both ways, response)", "Triton (queue, inputs, outputs)",
                          "client and gRPC"],
                         [[f"{rows['worker_job_ms']:.1f}", f"{rows['worker_communication_ms']:.1f}",
                           f"{rows['worker_wait_ms']:.2f}", f"{rows['stub_beyond_job_ms']:.2f}",
                           f"{rows['triton_ms']:.2f}", f"{rows['client_and_grpc_ms']:.2f}"]]))
    healing = ([f"{rows['heal_s']:.1f}", rows["heal_same_answer"]] if "heal_s" in rows else
               ["not healed within the timeout", ""] if "heal_error" in rows else ["not measured", ""])
    print()
    print(markdown_table([f"{rows['concurrency']} clients: p50 / p99 ms", "requests/s", "build s", "start to ready s",
                          "engine load + warm-up s (compile cache)", "healing: kill to answer s",
                          "same answer after healing"],
                         [[f"{rows['concurrent_p50_ms']:.0f} / {rows['concurrent_p99_ms']:.0f}",
                           f"{rows['throughput_per_s']:.2f}", f"{rows['build_s']:.0f}",
                           f"{rows['server_start_to_ready_s']:.0f}",
                           f"{rows['cached_load_s']:.1f} + {rows['cached_warm_up_s']:.1f}", *healing]]))
    print(f"\nThe same answer through gRPC messages and system shared memory: {rows['same_answer_every_way']}")


if __name__ == "__main__":
    main()
