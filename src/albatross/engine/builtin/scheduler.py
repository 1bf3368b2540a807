"""Thread-safe request queue and the worker thread that runs batches on a ``ModelRunner``.

Callers on any thread ``submit`` requests and get futures. The worker takes every pending request (up to
``max_batch_size``) as one batch; requests that arrive while a batch runs join the next batch. Weight swaps are
queued too and applied by the worker itself between two forward passes, never during one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from albatross.engine.base import Completion, SamplingParams
from albatross.engine.builtin.runner import ModelRunner, Request, validate_request


class EngineClosed(RuntimeError):
    """The engine was closed before the request or weight swap could finish."""


class _Swap:
    def __init__(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.state_dict, self.version = state_dict, version
        self.future: Future[None] = Future()


class Scheduler:
    """Batches requests from many threads onto one runner; see the module docstring."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 64) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.step_hook: Callable[[], None] | None = None
        """Called by the worker before every forward pass (tests use it to act at a known step)."""
        self._cond = threading.Condition()
        self._pending: deque[tuple[Request, Future[Completion]]] = deque()
        self._swaps: deque[_Swap] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="albatross-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ callers

    def submit_many(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Future[Completion]]:
        """Queue several requests at once (they land in the same batch when it has room)."""
        requests = [Request(list(p), params) for p in prompts]
        for r in requests:
            validate_request(r.prompt_ids, params, self.runner.vocab_size)
        futures: list[Future[Completion]] = [Future() for _ in requests]
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._pending.extend(zip(requests, futures, strict=True))
            self._cond.notify()
        return futures

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Completion]:
        return self.submit_many([prompt_ids], params)[0]

    def swap_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> Future[None]:
        """Queue a weight swap; the worker applies it before its next forward pass (or at once when idle)."""
        swap = _Swap(state_dict, version)
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._swaps.append(swap)
            self._cond.notify()
        return swap.future

    def has_pending_swap(self) -> bool:
        with self._cond:
            return bool(self._swaps)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker: the running batch ends at its next step with ``EngineClosed``, queued work too."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ worker

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._swaps or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                batch = [self._pending.popleft() for _ in range(min(self.max_batch_size, len(self._pending)))]
            self._apply_swaps()
            self._run_batch(batch)
        self._fail_queued()

    def _apply_swaps(self) -> None:
        while True:
            with self._cond:
                if not self._swaps:
                    return
                swap = self._swaps.popleft()
            try:
                self.runner.load_state_dict(swap.state_dict, swap.version)
            except Exception as exc:  # the caller validated already; report anything else to it
                swap.future.set_exception(exc)
            else:
                swap.future.set_result(None)

    def _between_steps(self) -> None:
        if self.step_hook is not None:
            self.step_hook()
        if self._closed:
            raise EngineClosed("the engine was closed during generation")
        self._apply_swaps()

    def _run_batch(self, batch: list[tuple[Request, Future[Completion]]]) -> None:
        live = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
        if not live:
            return
        futures = [f for _, f in live]
        try:
            self.runner.generate(
                [r for r, _ in live], self._between_steps, lambda i, c: futures[i].set_result(c)
            )
        except Exception as exc:
            for f in futures:
                if not f.done():
                    f.set_exception(exc)

    def _fail_queued(self) -> None:
        with self._cond:
            pending, swaps = list(self._pending), list(self._swaps)
            self._pending.clear()
            self._swaps.clear()
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed("the engine was closed before this request ran"))
        for swap in swaps:
            swap.future.set_exception(EngineClosed("the engine was closed before this weight swap"))
