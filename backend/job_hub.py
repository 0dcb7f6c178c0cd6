"""The control plane: rank 0 puts every job in one global order and tells all ranks to run it.

Triton hands a request to ONE instance, but the engine needs every rank. Each rank submits every
job it receives (a Submit: id, origin rank, input shapes; backend/messages.py) to the hub on rank 0,
over a Unix socket in the rendezvous epoch's directory; the hub sends each, numbered (a Run),
to all ranks, and all ranks run the jobs in that order. Tensors never pass through here: the origin rank
broadcasts the inputs over the communicator (NCCL/gloo).

The hub lives as long as one epoch. When a rank leaves (its process exited, so its socket
closed; or it ended the epoch after an error, saying why; or the model is unloading) the hub
tells every rank the epoch's end (an EndEpoch), with the reason and whether the model is
unloading, and ends: the epoch is over for all of them.

A world of one rank has nothing to order: it uses no hub, but a SingleRankLink, which hands its
jobs straight back to it.

An elastic model's hub also schedules (backend/job_scheduler.py): it holds the submitted jobs in arrival order and
starts each on a group of ranks when one is free, sending the Run, with the job's inputs (the Submit brings them in
host memory), to the group's ranks only, and to the origin, so it knows its job started. Jobs on disjoint groups run at
once; each rank runs the jobs of its groups in the one global order. The ranks say when they have finished a job
(Finished); the leader of its group sends its answer (Result) and progress, which the hub passes to the origin, so
the origin need not take part (it may be busy in another group). A job whose request no longer waits (Withdraw) is
dropped if it waits, or its group's leader is told to stop it; one past its deadline is dropped when it is looked at
(its request has been answered UNAVAILABLE by its stub already).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Client, Connection, Listener, wait

from mdtriton.backend.job_scheduler import MIN_SPEEDUP, GroupScheduler
from mdtriton.backend.messages import (EndEpoch, Finished, Hello, Leave, Message, Progress, ProtocolError, Result,
                                       Run, Submit, Withdraw, receive_over, send_over)
from mdtriton.backend.private_directory import PRIVATE_FILE_MODE
from mdtriton.engine.group_times import GroupTimes

log = logging.getLogger("mdtriton.backend")


class JobHub:
    """Runs on rank 0 in its own thread; lives as long as one rendezvous epoch."""

    def __init__(self, address: str, token: str, world_size: int,
                 partitions: dict[int, list[list[int]]] | None = None,
                 on_queue_length: Callable[[int], None] | None = None, group_times: GroupTimes | None = None,
                 min_speedup: float = MIN_SPEEDUP):
        """partitions: an elastic model's groups by size (each job runs on one of them); None: every job on every
        rank. on_queue_length(waiting): told, in the hub's thread, how many of an elastic model's jobs wait for a
        group, whenever that changes (the rank's metrics). group_times, min_speedup: the ranks' table of forward times
        by group size and what a larger group must gain, by which a lone job's group is sized (job_scheduler)."""
        self.address = address
        self.token = token
        self.world_size = world_size
        self.partitions = partitions
        self.group_times = group_times
        self.min_speedup = min_speedup
        self.on_queue_length = on_queue_length
        self._listener = Listener(address, family="AF_UNIX", authkey=token.encode())
        os.chmod(address, PRIVATE_FILE_MODE)  # its directory is private already; the socket too, for good measure
        self._stopping = threading.Event()
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._thread = threading.Thread(target=self._serve, name="mdtriton-job-hub", daemon=True)

    def start(self) -> "JobHub":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Tell every rank to stop (if the hub still runs) and end the hub's thread."""
        self._stopping.set()
        self._wake_writer.send(None)
        try:  # wakes accept() if not every rank has connected yet
            Client(self.address, family="AF_UNIX", authkey=self.token.encode()).close()
        except OSError:
            pass
        self._thread.join(timeout)
        self._wake_reader.close()
        self._wake_writer.close()

    def _serve(self) -> None:
        links: dict[int, Connection] = {}
        try:
            while len(links) < self.world_size:
                connection = self._listener.accept()
                if self._stopping.is_set():
                    connection.close()
                    break
                hello = receive_over(connection)
                if not isinstance(hello, Hello):
                    raise ProtocolError(f"a runner's first message is its rank, not {hello}")
                links[hello.rank] = connection
        except (EOFError, OSError, ProtocolError):
            pass  # a rank died while connecting (or speaks another protocol); the others learn it when the hub stops
        finally:
            self._listener.close()
        if len(links) < self.world_size or self._stopping.is_set():
            self._stop(links, "the ranks did not all connect to rank 0's job hub")
            return
        if self.partitions is not None:
            self._schedule(links)
            return
        ranks = {connection: rank for rank, connection in links.items()}
        sequence = 0
        while True:
            received = self._receive(links, ranks)
            if received is None:
                return
            for connection, message in received:
                match message:
                    case Submit(job=job, origin=origin, inputs=inputs):
                        sequence += 1
                        for link in links.values():
                            try:
                                send_over(link, Run(job, origin, inputs, sequence))
                            except OSError:
                                pass  # that rank is gone: its closed socket ends the epoch on the next wait()
                    case _:
                        self._stop(links, f"rank {ranks[connection]} sent the hub {message}, not a job or a leave")
                        return

    def _schedule(self, links: dict[int, Connection]) -> None:
        """An elastic model's jobs: start each on a free group as the policy says, until the epoch ends."""
        ranks = {connection: rank for rank, connection in links.items()}
        scheduler = GroupScheduler(self.partitions, self.group_times, self.min_speedup)
        log.info("job hub: a lone job takes a larger group if %gx as fast, by the ranks' forward times: %s",
                 self.min_speedup, self.group_times.describe() if self.group_times is not None else "none")
        origins: dict[str, int] = {}  # the origin of every job submitted and not yet answered
        sequence, reported = 0, 0

        def tell(rank: int, message: Message) -> None:
            try:
                send_over(links[rank], message)
            except OSError:
                pass  # that rank is gone: its closed socket ends the epoch on the next wait()

        def drop(submit: Submit, why: str) -> None:
            origins.pop(submit.job, None)
            tell(submit.origin, Result(submit.job, "stopped", why))

        while True:
            for submit in scheduler.expired(time.monotonic()):
                drop(submit, "past its deadline")
            while (started := scheduler.start_next()) is not None:
                submit, group = started
                sequence += 1
                for rank in group:
                    tell(rank, Run(submit.job, submit.origin, submit.inputs, sequence, group, submit.deadline,
                                   submit.tensors))
                if submit.origin not in group:
                    tell(submit.origin, Run(submit.job, submit.origin, submit.inputs, sequence, group))
            if len(scheduler.waiting) != reported and self.on_queue_length is not None:
                reported = len(scheduler.waiting)
                self.on_queue_length(reported)
            deadline = scheduler.next_deadline()
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0) + 0.01
            received = self._receive(links, ranks, timeout)
            if received is None:
                return
            for connection, message in received:
                match message:
                    case Submit() as submit:
                        origins[submit.job] = submit.origin
                        scheduler.submit(submit)
                    case Finished(job=job, rank=rank):
                        if scheduler.finished(job, rank):
                            origins.pop(job, None)  # answered by now (its leader's Result comes before its Finished)
                    case Result(job=job) if job in origins:
                        tell(origins.pop(job), message)
                    case Progress(id=job) if job in origins:
                        tell(origins[job], message)
                    case Result() | Progress():
                        pass  # its request was dropped meanwhile
                    case Withdraw(job=job) as withdraw:
                        found = scheduler.withdraw(job)
                        if isinstance(found, Submit):
                            drop(found, withdraw.reason)
                        elif found is not None:
                            tell(found.group[0], withdraw)
                    case _:
                        self._stop(links, f"rank {ranks[connection]} sent the hub {message}, not a job or a leave")
                        return

    def _receive(self, links: dict[int, Connection], ranks: dict[Connection, int],
                 timeout: float | None = None) -> list[tuple[Connection, Message]] | None:
        """The messages the ranks sent within timeout (None: until one comes), each with its rank's connection; None
        once the epoch has ended, every rank told why: rank 0 ended it, a rank disconnected, broke the
        protocol or left."""
        received = []
        for connection in wait(list(ranks) + [self._wake_reader], timeout):
            if connection is self._wake_reader:
                self._stop(links, "rank 0 ended this epoch")
                return None
            try:
                message = receive_over(connection)
            except (EOFError, OSError):
                self._stop(links, f"rank {ranks[connection]} disconnected")
                return None
            except ProtocolError as error:
                self._stop(links, f"rank {ranks[connection]}: {error}")
                return None
            if isinstance(message, Leave):
                self._stop(links, f"rank {ranks[connection]} left: {message.reason}", message.unloading)
                return None
            received.append((connection, message))
        return received

    @staticmethod
    def _stop(links: dict[int, Connection], reason: str, unloading: bool = False) -> None:
        for link in links.values():
            try:
                send_over(link, EndEpoch(reason, unloading))
            except OSError:
                pass
            link.close()


class HubLink:
    """One rank's connection to the hub: submit job headers, receive the ordered run list."""

    def __init__(self, address: str, token: str, rank: int, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._connection = Client(address, family="AF_UNIX", authkey=token.encode())
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0's job hub at {address} did not come up within {timeout:.0f} s") from None
                time.sleep(0.02)
        self._send_lock = threading.Lock()
        self.send(Hello(rank))

    def send(self, message: Message) -> None:
        with self._send_lock:
            send_over(self._connection, message)

    def fileno(self) -> int:
        """The connection's descriptor, to wait for its next message beside others
        (multiprocessing.connection.wait)."""
        return self._connection.fileno()

    def receive(self) -> Message:
        return receive_over(self._connection)

    def close(self) -> None:
        self._connection.close()


class SingleRankLink:
    """The job order of a world of one rank, in its own process: each job submitted comes straight back to be run,
    and a leave as the epoch's end, through an in-process pipe (the same calls and messages as HubLink, the
    answers the hub would give). No hub thread wakes and no socket is crossed twice: the hub's round trip took 0.6 ms
    of every request on the GPU hosts."""

    def __init__(self):
        self._reader, self._writer = Pipe(duplex=False)
        self._lock = threading.Lock()  # the runner thread submits; stop() leaves from another thread
        self._sequence = 0

    def send(self, message: Submit | Leave) -> None:
        with self._lock:
            match message:
                case Submit(job=job, origin=origin, inputs=inputs):
                    self._sequence += 1
                    answer = Run(job, origin, inputs, self._sequence)
                case Leave(reason=reason, unloading=unloading):
                    answer = EndEpoch(f"rank 0 left: {reason}", unloading)
                case _:
                    raise ProtocolError(f"a runner submits jobs and leaves, not {message}")
            send_over(self._writer, answer)

    def fileno(self) -> int:
        """The descriptor to wait for the next message on (multiprocessing.connection.wait)."""
        return self._reader.fileno()

    def receive(self) -> Message:
        return receive_over(self._reader)

    def close(self) -> None:
        with self._lock:
            self._writer.close()
            self._reader.close()
