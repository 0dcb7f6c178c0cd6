"""The backend's messages (backend/messages.py): over a real TensorLink (stub and worker) and a real pipe (runner and
job hub) each kind arrives as the record it was sent as, tensors included; a world of one rank's SingleRankLink answers
as the hub would; a header of a kind not listed is a ProtocolError, never taken for another kind."""

from __future__ import annotations

import socket
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import pytest
import torch

from mdtriton.backend.tensor_transfer import TensorLink
from mdtriton.backend.job_hub import SingleRankLink
from mdtriton.backend.messages import (Cancel, Done, EndEpoch, Ended, Failed, Finished, GivenUp, Hello, JobTimed,
                                       Leave, Loaded, Progress, ProtocolError, Refused, Result, Run, RunRequest, Serving,
                                       Started, Stop, Stopped, Submit, Withdraw, receive, receive_over, send, send_over)


@pytest.fixture
def links():
    ours, theirs = socket.socketpair()
    a, b = TensorLink(Connection(ours.detach())), TensorLink(Connection(theirs.detach()))
    yield a, b
    a.close()
    b.close()


def test_every_kind_arrives_as_it_was_sent(links):
    sender, receiver = links
    inputs = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    messages = [Stop(), Cancel("j1", "cancelled by its client"), Loaded(), Serving(3, {0: 101, 1: 102}),
                Started("j1"), Progress("j1", 2, 28), Refused("j2", "input 'x' holds NaN"),
                Failed("j2", "rank 1: OSError: disk gone"), Stopped("j1", 3, 28), JobTimed(0.5, 1.5, 0.25),
                Ended("rank 1 left", False), GivenUp("rank 0 could not load", True)]
    for message in messages:
        send(sender, message)
        assert receive(receiver) == message
    for message in (RunRequest("j3", 1234.5678901234, inputs), Done("j3", inputs)):
        send(sender, message)
        got = receive(receiver)
        assert type(got) is type(message) and got.id == "j3" and torch.equal(got.tensors["x"], inputs["x"])
    assert receive_after(sender, receiver, RunRequest("j3", 1234.5678901234, inputs)).deadline == 1234.5678901234


def receive_after(sender, receiver, message):
    send(sender, message)
    return receive(receiver)


def test_an_unknown_kind_is_a_protocol_error(links):
    sender, receiver = links
    sender.send({"type": "finished", "reason": "?"})
    with pytest.raises(ProtocolError, match="a message of unknown kind 'finished'"):
        receive(receiver)


def test_runner_and_hub_messages_arrive_as_sent_and_one_rank_is_answered_as_the_hub_would():
    reader, writer = Pipe(duplex=False)
    inputs = [["hidden_states", "FP32", [1, 4, 64]]]
    for message in (Hello(1), Submit("j1", 1, inputs), Leave("unloading", True), Run("j1", 1, inputs, 7),
                    EndEpoch("rank 1 left: out of memory", False)):
        send_over(writer, message)
        assert receive_over(reader) == message
    link = SingleRankLink()
    link.send(Submit("a", 0, inputs))
    link.send(Submit("b", 0, inputs))
    link.send(Leave("the model is being unloaded", True))
    assert [link.receive() for _ in range(3)] == [Run("a", 0, inputs, 1), Run("b", 0, inputs, 2),
                                                  EndEpoch("rank 0 left: the model is being unloaded", True)]
    with pytest.raises(ProtocolError, match="a runner submits jobs and leaves"):
        link.send(Hello(0))
    link.close()


def test_an_elastic_models_messages_carry_their_tensors_over_the_hub_link():
    """An elastic model's inputs and answers travel through the hub, in host memory, each dtype and shape as sent
    (an empty tensor too); the messages without tensors stay as they were."""
    reader, writer = Pipe(duplex=False)
    tensors = {"prompt": torch.tensor([[104, 105, 0]], dtype=torch.uint8),
               "scale": torch.tensor([0.5], dtype=torch.bfloat16), "empty": torch.empty(0, 3), "image": torch.arange(24, dtype=torch.float32).reshape(1, 2, 4, 3)}
    header = [["prompt", "UINT8", [1, 3]]]
    for message in (Submit("j1", 1, header, 12.5, tensors), Run("j1", 1, header, 3, [0, 1], 12.5, tensors),
                    Result("j1", "done", tensors=tensors)):
        send_over(writer, message)
        got = receive_over(reader)
        assert type(got) is type(message) and got.job == "j1"
        assert {name: (t.dtype, t.shape) for name, t in got.tensors.items()} == {
            name: (t.dtype, t.shape) for name, t in tensors.items()}
        assert all(torch.equal(got.tensors[name], tensor) for name, tensor in tensors.items())
    for message in (Finished("j1", 1), Withdraw("j1", "cancelled by its client"),
                    Result("j1", "stopped", done=2, total=9), Run("j2", 0, header, 4, [1]), Submit("j3", 0, header)):
        send_over(writer, message)
        assert receive_over(reader) == message
