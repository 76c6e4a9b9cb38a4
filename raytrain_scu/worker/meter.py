"""Training throughput between reports (evals excluded), peak device memory (allocated and reserved), and how long
each report blocked the loop."""
from __future__ import annotations

import contextlib
import time

import torch

from raytrain_scu.core.dist import notice0


class Meter:
    """Training throughput between reports (evals excluded), the peak device memory, and how long each report blocked
    the loop."""

    def __init__(self, device, poll_interval_s: float):
        self.device, self.poll_interval_s = device, poll_interval_s
        self.t_last, self.interval, self.report_wait, self.warned = time.perf_counter(), 0.0, 0.0, False
        # tokens over all ranks since the last lap (batches.step_counts): every token of text blocks; of examples,
        # their prompts and answers, never padding or a packed row's filler
        self.tokens = 0
        self.targets, self.targets_per_s = 0, 0.0  # of those, the target tokens (examples: the answers)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside (an eval) does not count as training time."""
        t0 = time.perf_counter()
        yield
        self.t_last += time.perf_counter() - t0

    def lap(self) -> float:
        """Tokens/s over all ranks since the last lap (and ``targets_per_s``, their target tokens); starts the next
        one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.interval, self.t_last = now - self.t_last, now
        tokens_per_s, self.tokens = self.tokens / self.interval, 0
        self.targets_per_s, self.targets = self.targets / self.interval, 0
        return tokens_per_s

    def max_mem_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0

    def max_reserved_gib(self) -> float:
        """The allocator's peak reserved memory: the allocated peak plus the cache's free blocks (which it releases and
        retries before it raises an out-of-memory error)."""
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
