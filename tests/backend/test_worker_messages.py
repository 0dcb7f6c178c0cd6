"""The stub-worker messages (backend/worker_messages.py) over a real TensorLink: each kind arrives as the record it
was sent as, tensors included; a header of a kind not listed is a ProtocolError, never taken for another kind."""

from __future__ import annotations

import socket
from multiprocessing.connection import Connection

import pytest
import torch

from mdtriton.backend.tensor_transfer import TensorLink
from mdtriton.backend.worker_messages import (Done, Ended, GivenUp, Job, JobTimed, Loaded, Progress, ProtocolError,
                                              Refused, Serving, Started, Stop, receive, send)


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
    messages = [Stop(), Loaded(), Serving(3, {0: 101, 1: 102}), Started("j1"), Progress("j1", 2, 28),
                Refused("j2", "input 'x' holds NaN"), JobTimed(0.5, 1.5, 0.25), Ended("rank 1 left", False),
                GivenUp("rank 0 could not load", True)]
    for message in messages:
        send(sender, message)
        assert receive(receiver) == message
    for message in (Job("j3", True, inputs), Done("j3", inputs)):
        send(sender, message)
        got = receive(receiver)
        assert type(got) is type(message) and got.id == "j3" and torch.equal(got.tensors["x"], inputs["x"])
    assert receive_after(sender, receiver, Job("j4", False, inputs)).progress is False


def receive_after(sender, receiver, message):
    send(sender, message)
    return receive(receiver)


def test_an_unknown_kind_is_a_protocol_error(links):
    sender, receiver = links
    sender.send({"type": "finished", "reason": "?"})
    with pytest.raises(ProtocolError, match="a message of unknown kind 'finished'"):
        receive(receiver)
