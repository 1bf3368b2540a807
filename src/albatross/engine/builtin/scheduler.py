"""Thread-safe request queue and the worker thread that drives a ``ModelRunner`` with continuous batching.

Callers on any thread ``submit`` requests and get futures. Before every decode step the worker admits waiting
requests into the running batch (up to ``max_batch_size`` rows, and ``max_prefill_tokens`` prompt tokens per
admission), so a request starts as soon as there is room and leaves as soon as it is done: it never waits for
the slowest request of a batch. Weight swaps are queued too and applied by the worker itself between two forward
passes, never during one; running requests continue with the new weights.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

import torch

from albatross.engine.base import Completion, EngineError, SamplingParams
from albatross.engine.builtin.runner import Done, ModelRunner, Request


class EngineClosed(EngineError):
    """The engine was closed before the request or weight swap could finish."""


class _Swap:
    def __init__(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.state_dict, self.version = state_dict, version
        self.future: Future[None] = Future()


def _resolver(future: Future[Completion]) -> Done:
    def done(result: Completion | BaseException) -> None:
        if future.done():  # already failed (a request may be failed both as a joiner and as a running row)
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    return done


class Scheduler:
    """Continuous batching of requests from many threads onto one runner; see the module docstring."""

    def __init__(self, runner: ModelRunner, max_batch_size: int, max_prefill_tokens: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.runner = runner
        # the transformers config's positions (a plain torch module has no config)
        self.positions: int | None = getattr(getattr(runner.model, "config", None), "max_position_embeddings", None)
        """The model's positions: a request's ``max_tokens`` is clamped to the room its prompt leaves."""
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.step_hook: Callable[[], None] | None = None
        self.busy_s = 0.0  # seconds spent in prefill and decode passes (idle share = 1 - busy / wall)
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
        """Queue several requests at once (they join the running batch together when there is room)."""
        requests = [Request(list(p), self._clamped(len(p), params)) for p in prompts]
        for r in requests:
            self.runner.validate(r.prompt_ids, params)
        futures: list[Future[Completion]] = [Future() for _ in requests]
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._pending.extend(zip(requests, futures, strict=True))
            self._cond.notify()
        return futures

    def _clamped(self, n_prompt: int, params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_tokens`` at most the positions left after the prompt (at least 1), so per-token
        buffers (sampling uniforms, KV) never grow past the model's positions; the request ends with "length"."""
        if not isinstance(self.positions, int) or params.max_tokens <= self.positions - n_prompt:
            return params
        return replace(params, max_tokens=max(1, self.positions - n_prompt))

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

    @property
    def n_waiting(self) -> int:
        return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker: running requests end at the next step with ``EngineClosed``, queued work too."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ worker

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._swaps or self._closed or self.runner.n_running):
                    self._cond.wait()
                if self._closed:
                    break
                joiners = self._take_joiners()
            try:
                self._iteration(joiners)
            except EngineClosed as exc:
                self._fail(joiners, exc)
                break
            except Exception as exc:  # a failed forward pass fails the requests it touched, not the engine
                self._fail(joiners, exc)
        self._fail(None, EngineClosed("the engine was closed during generation"))
        self._fail_queued()

    def _take_joiners(self) -> list[tuple[Request, Future[Completion]]]:
        room = self.max_batch_size - self.runner.n_running
        joiners: list[tuple[Request, Future[Completion]]] = []
        tokens = 0
        while self._pending and len(joiners) < room:
            n = len(self._pending[0][0].prompt_ids)
            if joiners and tokens + n > self.max_prefill_tokens:
                break
            joiners.append(self._pending.popleft())
            tokens += n
        return joiners

    def _iteration(self, joiners: list[tuple[Request, Future[Completion]]]) -> None:
        live = [(r, f) for r, f in joiners if f.set_running_or_notify_cancel()]
        if live:
            self._between_steps()
            t0 = time.perf_counter()
            try:
                self.runner.admit([(r, _resolver(f)) for r, f in live])
            finally:
                self.busy_s += time.perf_counter() - t0
        if self.runner.n_running:
            self._between_steps()
            t0 = time.perf_counter()
            try:
                self.runner.step()
            finally:
                self.busy_s += time.perf_counter() - t0
        elif not live:
            self._apply_swaps()

    def _fail(self, joiners: list[tuple[Request, Future[Completion]]] | None, exc: BaseException) -> None:
        for _, future in joiners or []:
            if future.running():
                future.set_exception(exc)
        self.runner.fail_all(exc)

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
