"""The engine bench's instruments: a generate() streamer that timestamps every new token, a sampler of the
process's peak resident memory, and the copy bandwidth of a device's memory."""

from __future__ import annotations

import threading
import time


class Clock:
    """A generate() streamer that records when each new token exists (device synchronized)."""

    def __init__(self, sync):
        self.sync, self.times, self.prompt_seen = sync, [], False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first streams the prompt
            self.prompt_seen = True
            return
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class RssPeak:
    """Peak resident memory of this process while a block runs (sampled every 2 ms)."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()


def measure_copy_bandwidth(device: str = "cpu", sync=lambda: None, megabytes: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth of a device's memory in bytes/s, best of `repeats` (a copy reads and writes each byte)."""
    import torch

    a = torch.ones(megabytes * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t0))
    return best
