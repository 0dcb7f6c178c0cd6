"""The embedded server: the Triton Inference Server shipped in the nvidia-pytriton wheel, run on a repository.

It needs no Docker: the wheel carries `tritonserver` 2.51 with the Python backend. We assemble a
backend directory for the running Python, point the stubs at this environment's packages, pick
free ports on 127.0.0.1 and wait until the server is ready. Its shared-memory and model-repository protocols take
requests only with its key (client/server_key.py), and each stub's shared memory region is made private to the
server's user before the stub starts (STUB_WRAPPER).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from functools import partial
from importlib.util import find_spec
from pathlib import Path

from mdtriton.backend.private_directory import DirectoryNotPrivate, make_private_directory, write_private_file
from mdtriton.backend.process_state import end_with_parent
from mdtriton.client.server_key import RESTRICTED_KEY, RESTRICTED_PROTOCOLS, key_file
from mdtriton.stub_environment import stub_environment


class ServerError(Exception):
    """The server could not be started or did not become ready."""


def triton_dir() -> Path:
    spec = find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("the Triton server is not installed: run `pip install --no-deps nvidia-pytriton==0.7.0`")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


# Ports handed out by free_port in this process, never handed out twice.
_PORTS_GIVEN: set[int] = set()
# Triton's own default ports, where its clients (and ours) look first; `mdtriton serve` takes them when they are free.
TRITON_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (and bind to port 0)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind port on host now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on host, outside the ephemeral range: between this call and the server's bind, an outgoing
    connection (a client's, say) could take a free ephemeral port, and the server would fail to start."""
    ephemeral = ephemeral_ports()
    candidates = [port for port in range(10000, 65536) if port not in ephemeral and port not in _PORTS_GIVEN]
    for port in random.sample(candidates, 200):
        if port_is_free(host, port):
            _PORTS_GIVEN.add(port)
            return port
    raise ServerError(f"no free port on {host} outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1}")


# Triton 2.51's Python backend creates each stub's region of /dev/shm with mode 0644 (boost's default, set by fchmod:
# the umask does not help), so every local user could read the requests' tensors in it. The backend starts a stub as
# `bash -c "exec B/python/triton_python_backend_stub MODEL_FILE REGION ..."`: this wrapper in the stub's place makes
# REGION 0600 (the server and the stub, of the same user, keep their access) and then runs the real stub under the
# wrapper's name (as before, so that `ps` shows the same). Without arguments the real stub exits 1, which the backend
# checks before it starts any stub.
STUB_WRAPPER = """#!/bin/bash
if [ "$#" -ge 2 ]; then chmod 600 "/dev/shm/$2" || exit 1; fi
exec -a "$0" "{stub}" "$@"
"""


def make_backend_dir(target: Path) -> Path:
    """B/python/ with the Python backend and, in the stub's place, a wrapper (STUB_WRAPPER) of the stub built for
    this interpreter's version."""
    server = triton_dir()
    python = target / "python"
    python.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    for source in (server / "backends/python/libtriton_python.so",
                   server / "backends/python/triton_python_backend_utils.py"):
        link = python / source.name
        if not link.exists():
            link.symlink_to(source)
    wrapper = python / stub.name
    wrapper.write_text(STUB_WRAPPER.format(stub=stub))
    wrapper.chmod(0o700)
    return target


def server_environment() -> dict[str, str]:
    """The stubs embed libpython and see no virtualenv by themselves: hand them our packages and libraries, and
    numpy 1.26 first (mdtriton.stub_environment: BYTES inputs)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(stub_environment() / "bin")] + [p for p in [env.get("PATH")] if p])
    libs = triton_dir().parent.parent / "nvidia_pytriton.libs"
    # This process's mdtriton first, so the stubs run the same code as the launcher (a checkout too).
    python_path = [str(Path(find_spec("mdtriton").origin).parent.parent)] + site.getsitepackages()
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libs)] + [p for p in [env.get("LD_LIBRARY_PATH")] if p]
                                             + libpython_directories(sysconfig.get_config_var("LIBDIR"),
                                                                     sysconfig.get_config_var("MULTIARCH")))
    env["PYTHONPATH"] = os.pathsep.join(python_path + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def libpython_directories(libdir: str, multiarch: str | None) -> list[str]:
    """Where the stubs find libpython: libdir, unless the loader searches it anyway (a system directory). A system
    directory must stay off LD_LIBRARY_PATH, even last: the loader reads LD_LIBRARY_PATH before a library's RUNPATH,
    so an older cuDNN there (9.14 beside torch's 9.19 on hosts with CUDA's packages) is found before torch's own by
    every process the stubs start, and torch quietly runs its slower flash attention instead of cuDNN's (Qwen-Image's
    served image took 1.16x diffusers' time on one H200 with it there, 1.03x without: docs/benchmarks.md)."""
    system = {"/lib", "/lib64", "/usr/lib", "/usr/lib64"}
    if multiarch:
        system |= {f"/lib/{multiarch}", f"/usr/lib/{multiarch}"}
    return [] if os.path.normpath(libdir) in system else [libdir]


# Triton's Python backend keeps each stub's shared memory in a file of /dev/shm named so; a server that crashes (with
# its stubs) leaves them there, a memory of 1 MiB and more each that nothing frees until the machine restarts.
SHARED_MEMORY_DIR = Path("/dev/shm")
SHARED_MEMORY_PREFIX = "triton_python_backend_shm_region_"
# Younger regions are left alone: a process may map one and close its descriptor between our reading its maps and its
# descriptors.
SHARED_MEMORY_MIN_AGE_S = 5.0


def held_files() -> set[str]:
    """The paths that live processes have mapped or open (those whose /proc entries this user may read)."""
    held = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for line in (entry / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode, path (if any)
                if len(fields) == 6:
                    held.add(fields[5])
            for descriptor in (entry / "fd").iterdir():
                held.add(os.readlink(descriptor))
        except OSError:
            continue  # gone, or another user's: it cannot write-map this user's regions anyway
    return held


def remove_left_shared_memory() -> list[Path]:
    """Remove the Python backend's shared memory regions of this user that no live process holds (a crashed server's,
    which live servers' stubs never share: each region is one stub's); return them."""
    now = time.time()
    left = []
    for region in SHARED_MEMORY_DIR.glob(SHARED_MEMORY_PREFIX + "*"):
        try:
            status = region.stat()
        except OSError:
            continue
        if status.st_uid == os.getuid() and now - status.st_mtime > SHARED_MEMORY_MIN_AGE_S:
            left.append(region)
    if not left:
        return []
    held = held_files()
    removed = []
    for region in left:
        if str(region) not in held:
            region.unlink(missing_ok=True)
            removed.append(region)
    return removed


# A server's backend directory (make_backend_dir) is a temporary directory named after the process that started the
# server: a process killed by SIGKILL cannot remove its own, so the next server started removes those of dead owners.
BACKEND_DIR_PREFIX = "mdtriton-backends-"


def remove_left_backend_dirs() -> list[Path]:
    """Remove this user's backend directories whose owner process has exited; return them."""
    removed = []
    for directory in Path(tempfile.gettempdir()).glob(BACKEND_DIR_PREFIX + "*"):
        owner = directory.name.removeprefix(BACKEND_DIR_PREFIX).split("-")[0]
        try:
            if not owner.isdigit() or directory.stat().st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)
            continue  # its owner lives
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
        except OSError:
            continue  # gone meanwhile, or a live process of another user (PermissionError)
    return removed


def blank_in_command_line(pid: int, text: str) -> None:
    """Overwrite text with x's wherever it stands in process pid's command line (its arguments' memory).

    Why: Triton 2.51 takes the restricted protocols' key only as an argument, and any local user can read a
    process's arguments (/proc/PID/cmdline, ps). Once the server is ready it has long parsed them, so they can go.
    Writing another process's memory needs ptrace rights on it: ours, as its parent, under Yama's default scope."""
    # /proc/PID/stat's fields after the command's name, from field 3 (state) on: arg_start and arg_end are 48 and 49.
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    start, end = int(fields[45]), int(fields[46])
    secret = text.encode()
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        arguments = memory.read(end - start)
        at = arguments.find(secret)
        while at >= 0:
            memory.seek(start + at)
            memory.write(b"x" * len(secret))
            at = arguments.find(secret, at + len(secret))


class TritonServer:
    """A running tritonserver process; use as a context manager or call start() and stop()."""

    def __init__(self, repository: Path, host: str = "127.0.0.1", grpc_port: int | None = None,
                 http_port: int | None = None, metrics_port: int | None = None,
                 model_control_mode: str = "none", load_models: tuple[str, ...] = (), log_file: Path | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise ServerError(f"model repository {self.repository} does not exist")
        self.host = host
        self.grpc_port = grpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.model_control_mode = model_control_mode
        self.load_models = load_models
        self.log_file = log_file
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self._backend_tmp: tempfile.TemporaryDirectory | None = None
        # The key of the restricted protocols (client/server_key.py), written to key_file while the server runs.
        self.key = secrets.token_urlsafe(32)
        self.key_file = key_file(self.grpc_port)
        self._key_written = False

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, backend_dir: Path) -> list[str]:
        command = [
            str(triton_dir() / "bin/tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={self.model_control_mode}",
            # config.pbtxt is complete (mdtriton build writes it): skip the extra stub process per load that
            # Triton would start only to ask model.py for a config (seconds per load on a small machine).
            "--disable-auto-complete-config",
            # Shared memory (any file of /dev/shm, the Python backend's regions included) and model control only for
            # clients holding the key: see client/server_key.py.
            f"--grpc-restricted-protocol={','.join(RESTRICTED_PROTOCOLS)}:{RESTRICTED_KEY}={self.key}",
            f"--http-restricted-api={','.join(RESTRICTED_PROTOCOLS)}:{RESTRICTED_KEY}={self.key}",
        ]
        command += [f"--load-model={name}" for name in self.load_models]
        return command + list(self.extra_args)

    def start(self, timeout: float = 300.0) -> "TritonServer":
        removed = remove_left_shared_memory()
        if removed:
            print(f"mdtriton: removed {len(removed)} shared memory region(s) that a crashed Triton server left in "
                  f"{SHARED_MEMORY_DIR} ({', '.join(region.name for region in removed)})", file=sys.stderr)
        remove_left_backend_dirs()
        self._backend_tmp = tempfile.TemporaryDirectory(prefix=f"{BACKEND_DIR_PREFIX}{os.getpid()}-")
        backend_dir = make_backend_dir(Path(self._backend_tmp.name))
        output = open(self.log_file, "ab") if self.log_file else None
        # A session of its own, so stop() can end the server and every stub process it started; and a SIGTERM from
        # the kernel when this process exits without stop() (killed, or a test run's timeout), so that no server
        # outlives it: Triton then unloads its models, and their stubs and rank workers end. (The kernel sends it when
        # the thread that started the server exits: start servers from a thread that outlives them, as our tools
        # do from their main thread.)
        self.process = subprocess.Popen(self.command(backend_dir), env=server_environment(), stdout=output,
                                        stderr=subprocess.STDOUT if output else None, start_new_session=True,
                                        preexec_fn=partial(end_with_parent, os.getpid(), signal.SIGTERM))
        if output:
            output.close()
        try:
            self.wait_ready(timeout)
            self.write_key()
        except BaseException:
            self.stop()
            raise
        try:
            blank_in_command_line(self.process.pid, self.key)
        except OSError as error:
            print(f"mdtriton: could not blank the server's key in its command line ({error}): other local users can "
                  f"read it there (ps); docs/deploy.md says how to keep them out", file=sys.stderr)
        return self

    def write_key(self) -> None:
        """Write the key to key_file, private to this user: only once the server is ready, so that one that could not
        start (its port taken, say) never replaces a running server's key."""
        try:
            make_private_directory(self.key_file.parent, "XDG_RUNTIME_DIR")
        except DirectoryNotPrivate as error:
            raise ServerError(f"cannot keep the server's key: {error}") from None
        write_private_file(self.key_file, self.key + "\n")
        self._key_written = True

    def wait_ready(self, timeout: float) -> None:
        """Wait until the server says it is ready and its metrics endpoint (started after the others) answers."""
        deadline = time.monotonic() + timeout
        waiting_for = [f"http://{self.http_address}/v2/health/ready", self.metrics_url]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                  + (f"; see {self.log_file}" if self.log_file else ""))
            try:
                with urllib.request.urlopen(waiting_for[0], timeout=2) as response:
                    if response.status == 200:
                        waiting_for.pop(0)
                        if not waiting_for:
                            return
                        continue
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready within {timeout:.0f} s"
                          + (f"; see {self.log_file}" if self.log_file else ""))

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (Triton unloads its models, calling finalize on every rank); SIGKILL what is left."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        if self._backend_tmp is not None:
            self._backend_tmp.cleanup()
            self._backend_tmp = None
        if self._key_written:
            self.key_file.unlink(missing_ok=True)
            self._key_written = False

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
