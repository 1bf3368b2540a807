"""Fault injection for tests of the retry path: a seeded share of forks fails, for real.

``FaultInjector(rate, seed)``: each fork draws once. With probability ``rate`` it fails, half the time
before the attempt exists (``ForkError``, as when the zygote cannot fork) and half the time after (its
sandbox is killed right away, so the next call on it raises ``SandboxDied``, as when it dies in use).
"""

from __future__ import annotations

import random
import threading
from collections import Counter

FAULT_FORK = "fork_failed"
FAULT_DIE = "sandbox_died"


class FaultInjector:
    def __init__(self, rate: float = 0.0, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def draw(self) -> str:
        """"" (no fault), FAULT_FORK or FAULT_DIE."""
        if self.rate <= 0.0:
            return ""
        with self._lock:
            self.counts["forks"] += 1
            if self._rng.random() >= self.rate:
                return ""
            fault = FAULT_FORK if self._rng.random() < 0.5 else FAULT_DIE
            self.counts[fault] += 1
            return fault
