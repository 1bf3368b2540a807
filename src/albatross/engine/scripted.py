"""A deterministic scripted engine: replays fixed actions. For oracle demonstrations and tests."""

from __future__ import annotations

from collections.abc import Callable

from albatross.engine.base import Completion, SamplingParams, SingleEngine


class ScriptedEngine(SingleEngine):
    """Answers the i-th call with the i-th scripted action (as token ids), then repeats the last one.

    ``encode`` turns an action text into ids (for example ``TinyChatFormat.action``). Log-probs are 0.0
    and every token carries ``version``.
    """

    def __init__(self, actions: list[str], encode: Callable[[str], list[int]], version: int = 0) -> None:
        if not actions:
            raise ValueError("ScriptedEngine needs at least one action")
        self.actions, self.encode, self.version = list(actions), encode, version
        self.calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for _ in prompts:
            text = self.actions[min(self.calls, len(self.actions) - 1)]
            self.calls += 1
            ids = self.encode(text)
            out.append(Completion(ids, [0.0] * len(ids), [self.version] * len(ids), "stop"))
        return out

    def update_weights(self, path: str, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass
