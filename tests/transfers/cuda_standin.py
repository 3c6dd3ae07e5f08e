"""The CUDA backend's logic on host tensors, for machines without a GPU.

Only what cannot run here is replaced: streams and events by objects that
record what was asked of them (an event is complete once recorded, unless a
test says otherwise), and the device-id upload by a host tensor. The copies
themselves are the backend's own torch (or batch) code on host memory.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvledger.transfers.copies.cuda_backend import CudaBackend


class FakeStream:
    def __init__(self, device=None) -> None:
        self.waits: list[object] = []
        self.synchronized = 0

    def wait_stream(self, other) -> None:
        self.waits.append(other)

    def wait_event(self, event) -> None:
        self.waits.append(event)

    def synchronize(self) -> None:
        self.synchronized += 1


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_on = None
        self.enable_timing = enable_timing
        self.complete = True

    def record(self, stream) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing and end.enable_timing, "a timed copy needs timing events at both ends"
        return 1.5  # milliseconds


class HostStandIn(CudaBackend):
    """The CUDA data path with host tensors."""

    @staticmethod
    def _check_device(layout) -> None:
        pass

    def _device_ids(self, ids, keep):
        tensor = torch.tensor(ids, dtype=torch.long)
        keep.append(tensor)
        return tensor


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch, event_cls=FakeEvent) -> FakeStream:
    """Streams and events stand-ins; returns the compute stream."""
    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", event_cls)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    return compute
