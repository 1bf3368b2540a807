"""The demo as the slow integration tests run it."""

from albatross.bench.loop import QUICK_OVERRIDES

# `demo --quick` on bench loop's tiny task set (16 training tasks, a 60-step warm start, groups of 4, one
# evaluation trial): the warm start the first test caches in ``demo_cache`` serves every other one, and a step
# takes seconds
TINY_DEMO_ARGS = [f"--{kv}" for kv in QUICK_OVERRIDES]
