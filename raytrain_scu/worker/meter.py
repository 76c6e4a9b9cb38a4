"""Training throughput between reports (evals excluded), how much of it the host spent waiting for the device, peak
device memory, and how long each report blocked the loop."""
from __future__ import annotations

import contextlib
import time

import torch

from raytrain_scu.core.dist import notice0


class Meter:
    """Training throughput between reports (evals excluded), the share of it the host waited for the device at the
    steps' syncs (``sync_wait_frac``: near 0, the device waits on the host's launches instead, and a faster host
    loop would speed training up), and how long each report blocked the loop."""

    def __init__(self, device, tokens_per_step: int, poll_interval_s: float):
        self.device, self.tokens_per_step, self.poll_interval_s = device, tokens_per_step, poll_interval_s
        self.t_last, self.steps, self.interval, self.report_wait, self.warned = time.perf_counter(), 0, 0.0, 0.0, False
        self.sync_wait, self.sync_wait_frac = 0.0, 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside (an eval) does not count as training time."""
        t0 = time.perf_counter()
        yield
        self.t_last += time.perf_counter() - t0

    @contextlib.contextmanager
    def sync(self):
        """Time the step's wait for the device."""
        t0 = time.perf_counter()
        yield
        self.sync_wait += time.perf_counter() - t0

    def lap(self) -> float:
        """Tokens/s over all ranks since the last lap (and ``sync_wait_frac`` over it); starts the next one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.interval, self.t_last = now - self.t_last, now
        self.sync_wait_frac, self.sync_wait = self.sync_wait / self.interval, 0.0
        tokens_per_s, self.steps = self.tokens_per_step * self.steps / self.interval, 0
        return tokens_per_s

    def max_mem_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0

    def max_reserved_gib(self) -> float:
        """The allocator's peak reserved memory: what an out-of-memory error is decided by (allocated plus the
        cache's free blocks)."""
        return torch.cuda.max_memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else 0.0

    @contextlib.contextmanager
    def reporting(self, warn: bool):
        """Time a report; with ``warn``, say once when it blocked training for long (Ray's poll is too slow)."""
        t0 = time.perf_counter()
        yield
        self.report_wait = time.perf_counter() - t0
        if warn and not self.warned and self.report_wait > max(0.05, 0.1 * self.interval):
            self.warned = True
            notice0(f"warning: reporting to Ray blocked training for {self.report_wait:.2f} s after a "
                    f"{self.interval:.2f} s interval: reports come faster than Ray's controller takes them (every "
                    f"scaling.poll_interval_s={self.poll_interval_s} s). Raise train.report_every or lower "
                    f"scaling.poll_interval_s.")
