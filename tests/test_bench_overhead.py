"""``tools/bench.py overhead``'s host-only timing (CPU, a simulated GPU): each batch of calls queued
behind a GPU sleep measures the host alone, even for an op whose kernels take longer than its host
time (where the back-to-back loop measures the GPU), and the GPU's own time per call; a call that
waits for the GPU is reported, not timed."""
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import bench_overhead  # noqa: E402


class FakeGpu:
    """One stream: work queued at host time h starts when the GPU is free (or at h) and runs its
    duration; an event completes when the GPU reaches it. Times in seconds."""

    def __init__(self):
        self.host = 0.0
        self.free_at = 0.0

    def queue(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host) + seconds

    def call(self, host_s: float, gpu_s: float) -> None:
        self.host += host_s
        self.queue(gpu_s)

    def synchronize(self) -> None:
        self.host = max(self.host, self.free_at)

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = max(gpu.free_at, gpu.host)

            def query(self):
                return gpu.host >= self.at

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

        return Event


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu()
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: fake.queue(cycles / 2.0e9))
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(torch.cuda, "Event", fake.event_class())
    monkeypatch.setattr(bench_overhead, "time", types.SimpleNamespace(perf_counter=lambda: fake.host))
    return fake


def test_the_host_time_of_an_op_whose_kernels_outlast_it(gpu):
    add = lambda: gpu.call(5e-6, 2e-6)        # noqa: E731  host-bound: 5 us host, 2 us GPU
    decode = lambda: gpu.call(4e-6, 12e-6)    # noqa: E731  GPU-bound: 4 us host, 12 us GPU
    (add_us, add_ratio, add_gpu), (us, ratio, gpu_us) = bench_overhead._host_rounds([add, decode], 1000, 3)
    assert add_us == pytest.approx(5.0) and add_ratio == pytest.approx(1.0) and add_gpu == pytest.approx(2.0)
    assert us == pytest.approx(4.0) and ratio == pytest.approx(0.8)
    assert gpu_us == pytest.approx(12.0)
    # the back-to-back loop of the first table waits for the GPU: it measures 12 us, not 4
    (_, _), (loop_us, _) = bench_overhead._rounds([add, decode], 1000, 3, sync=gpu.synchronize)
    assert loop_us == pytest.approx(12.0, rel=0.01)


def test_a_call_that_waits_for_the_gpu_is_reported_not_timed(gpu):
    def syncing():
        gpu.call(3e-6, 1e-6)
        gpu.synchronize()

    with pytest.raises(RuntimeError, match="waits for the GPU"):
        bench_overhead._host_rounds([lambda: gpu.call(5e-6, 2e-6), syncing], 400, 1)
