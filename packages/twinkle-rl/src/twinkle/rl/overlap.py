"""Off-policy overlap: sample step k+1 in a background thread while step k trains.

The loop stays the user's; this class only owns the one background sampling job:

    rollouts = OverlappedRollouts(lambda prompts: sample_rollout(sampler, prompts, params, "policy"),
                                  max_staleness=1, timer=timer)
    rollouts.start(prompts_0)
    for step in range(n):
        rollout = rollouts.wait(policy_version=step)     # sampled with weights of step-1 (stale by 1)
        engine.sync(model, sampler, "policy")            # sampler is idle here: no torn weights
        rollouts.start(prompts_for(step + 1))            # sampling k+1 overlaps training k
        ...reward, advantage, forward_backward, clip_grad_and_step...

Weights must reach the sampler as a snapshot (`InProcessCheckpointEngine(copy=True)`), since the
trainer updates its own tensors in place while the sampler runs. The importance-sampling correction
is the loss's: the rollout's `logprobs` are the behaviour policy q (the stale weights), and
GRPO/PPO losses weight each token by the clipped ratio π_θ/q.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class StaleRolloutError(RuntimeError):
    pass


class OverlappedRollouts:
    def __init__(self, sample_fn: Callable, max_staleness: int = 1, timer=None):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        self.sample_fn, self.max_staleness, self.timer = sample_fn, max_staleness, timer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinkle-rollout")
        self._pending: Future | None = None
        self.waited_seconds = 0.0
        self.staleness: list[int] = []

    def _run(self, args, kwargs):
        start = time.perf_counter()
        try:
            return self.sample_fn(*args, **kwargs)
        finally:
            if self.timer is not None:
                self.timer.add("sample", time.perf_counter() - start)

    def start(self, *args, **kwargs) -> None:
        """Begin sampling in the background with the sampler's current weights."""
        if self._pending is not None:
            raise RuntimeError("a rollout is already in flight: wait() for it before starting the next")
        self._pending = self._pool.submit(self._run, args, kwargs)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def wait(self, policy_version: int):
        """The rollout started last. `policy_version` is the version the trainer's weights have now
        (the number of syncs so far); the rollout's staleness is that minus the oldest weight
        version it was sampled with, and must not exceed `max_staleness`."""
        if self._pending is None:
            raise RuntimeError("no rollout in flight: call start() first")
        start = time.perf_counter()
        try:
            rollout = self._pending.result()
        finally:
            self._pending = None
            self.waited_seconds += time.perf_counter() - start
        staleness = policy_version - min(rollout.weight_versions)
        if staleness > self.max_staleness:
            raise StaleRolloutError(
                f"rollout sampled with weight version {min(rollout.weight_versions)} is "
                f"{staleness} steps behind the policy (version {policy_version}); "
                f"max_staleness={self.max_staleness}: sync weights before each start()"
            )
        rollout.meta["staleness"] = staleness
        self.staleness.append(staleness)
        return rollout

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
