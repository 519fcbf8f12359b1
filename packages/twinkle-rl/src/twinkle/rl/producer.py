"""Asynchronous RL with bounded staleness: rollouts sampled beside training into a bounded queue.

The loop stays the user's; the producer owns only the sampling side:

    producer = RolloutProducer(lambda i: sample_rollout(sampler, prompts_for(i), params_for(i), "policy"),
                               engine, sampler, "policy", max_staleness=2)
    producer.publish(model)                    # version 0's weights; sampling starts
    for step in range(steps):
        rollout = producer.get()               # batch `step`, sampled with weights <= 2 versions old
        ...reward, advantage, forward_backward, clip_grad_and_step...
        producer.publish(model)                # the sampler applies it before its next batch
        log(producer.step_metrics())           # staleness, queue depth, sampler / trainer busy time

Sampling runs in a thread of this process. Where the sampler lives decides where it computes: beside
the trainer in local mode, or on its own DeviceGroup in Ray mode (`TorchSampler(remote_group='sampler')`
beside `TransformersModel(remote_group='model')`: the thread only waits on the sampler group).

Weights move through the CheckpointEngine's two halves: the trainer `publish`es a snapshot after its
step (`InProcessCheckpointEngine`, or `FolderCheckpointEngine` for remote groups), and the producer
`apply`s the newest one between batches, so a batch never mixes two versions.

Staleness is counted in policy versions (one per publish, the trainer publishing once per step): a
rollout's staleness is the trainer's version when it is trained on minus the version that sampled
it. Over-stale rollouts are *waited for, never dropped*: the producer does not start batch b until the
trainer has published version b − max_staleness, so no sample is thrown away and every batch arrives
at most `max_staleness` versions old. `max_staleness=0` is the synchronous loop (each batch sampled
with the weights that train on it); 1 samples step k+1 while step k trains. The loss corrects for the
gap: a rollout's `logprobs` are the behaviour policy's, and GRPO/PPO/CISPO/GSPO/importance-sampling
losses weight each token by π_θ/q against them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager

from twinkle.rl.rollout import Rollout


class RolloutProducer:
    def __init__(
        self,
        sample: Callable[[int], Rollout],
        engine,
        sampler,
        adapter_name: str,
        max_staleness: int = 1,
        queue_size: int | None = None,
        start_index: int = 0,
        queued: list[Rollout] | None = None,
    ):
        """`sample(b)` samples batch b with the sampler's current weights (a rule of b alone, such as
        prompts and a seed drawn from (run seed, b), makes a resumed run draw the same batches).
        `queue_size`: finished batches held at most (default max(1, max_staleness)). `start_index`
        and `queued`: where a resumed run goes on (`state()` of the saved run)."""
        if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        queue_size = max(1, max_staleness) if queue_size is None else queue_size
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be an int >= 1, got {queue_size!r}")
        self.sample, self.engine, self.sampler, self.adapter_name = sample, engine, sampler, adapter_name
        self.max_staleness, self.queue_size = max_staleness, queue_size
        self._cond = threading.Condition()
        self._queue: deque[Rollout] = deque(queued or ())
        self._next_index = start_index + len(self._queue)
        self._produced = len(self._queue)  # batches made or restored: batch p waits for publish p - S
        self._publishes = 0
        self._published: tuple[int, object] | None = None  # (version, payload) of the newest publish
        self._applied_version: int | None = None
        self._sampling = self._closed = False
        self._pauses = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None  # start of the sampling in progress
        self._sampler_busy = self._trainer_wait = self._paused_s = 0.0  # since the last step_metrics()
        self._mark = time.perf_counter()
        self._last: dict[str, float] = {}

    # ---- trainer side ------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int | None:
        """The version of the newest published weights (the trainer's)."""
        return None if self._published is None else self._published[0]

    def publish(self, model) -> int:
        """Snapshot the trainer's adapter (the engine's `publish`); the sampler serves it from its next
        batch. The first publish starts sampling. Returns the new version."""
        payload = self.engine.publish(model, self.adapter_name)
        version = self.engine.versions[self.adapter_name]  # every engine's publish numbers it
        with self._cond:
            if self._error is not None or self._closed:
                raise RuntimeError("the rollout producer has stopped") from self._error
            self._published, self._publishes = (version, payload), self._publishes + 1
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="twinkle-rollout-producer", daemon=True)
                self._thread.start()
        return version

    def get(self) -> Rollout:
        """The next batch in order. Its `meta` gets `staleness` (max over its samples), `staleness_mean`,
        `policy_version` and `batch_index`."""
        start = time.perf_counter()
        with self._cond:
            depth = len(self._queue)
            while not self._queue:
                if self._error is not None:
                    raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
                if self._thread is None or self._closed:
                    raise RuntimeError("no batch can come: publish(model) first, and get() before close()")
                if self._pauses:
                    raise RuntimeError("get() inside paused(): the producer samples nothing until it resumes")
                if not self._sampling and self._version_gate_closed():
                    raise RuntimeError(
                        f"deadlock: batch {self._next_index} waits for weights published after it is due "
                        f"(max_staleness={self.max_staleness}); publish(model) after every step, before get()"
                    )
                self._cond.wait()
            rollout = self._queue.popleft()
            self._cond.notify_all()
            version = self.policy_version
            self._trainer_wait += time.perf_counter() - start
        assert version is not None  # a batch exists only after a publish
        behind = [version - v for v in rollout.weight_versions]
        if max(behind) > self.max_staleness:  # the gate makes this impossible while publishes follow steps
            raise RuntimeError(f"a rollout {max(behind)} versions old passed max_staleness={self.max_staleness}")
        rollout.meta.update(staleness=max(behind), staleness_mean=sum(behind) / len(behind), policy_version=version)
        self._last = {
            "async/staleness_mean": sum(behind) / len(behind),
            "async/staleness_max": float(max(behind)),
            "async/queue_depth": float(depth),
        }
        return rollout

    def step_metrics(self) -> dict[str, float]:
        """Since the last call (a step): staleness of the last batch taken (mean / max over its
        samples), finished batches waiting when it was taken, the step's wall seconds (time inside
        `paused()` left out), seconds the sampler was busy and the trainer was busy (not waiting in
        get()), and their shares of the step."""
        now = time.perf_counter()
        with self._cond:
            busy = self._sampler_busy + (now - self._busy_since if self._busy_since is not None else 0.0)
            if self._busy_since is not None:
                self._busy_since = now
            wall, wait = now - self._mark - self._paused_s, self._trainer_wait
            self._sampler_busy = self._trainer_wait = self._paused_s = 0.0
            self._mark = now
        out = {**self._last, "time/step": wall, "time/sampler_busy": busy, "time/trainer_busy": wall - wait}
        if wall > 0:
            out.update({"share/sampler_busy": busy / wall, "share/trainer_busy": (wall - wait) / wall})
        return out

    @contextmanager
    def paused(self):
        """Inside, the sampler samples nothing for the producer (the batch in progress finishes first)
        and serves the newest published weights: for evaluating the policy on the same sampler."""
        with self._cond:
            self._pauses += 1
            while self._sampling:
                self._cond.wait()
        start = time.perf_counter()
        try:
            self._apply_newest()
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._paused_s += time.perf_counter() - start  # neither side's work: out of the step
                self._cond.notify_all()

    def state(self) -> dict:
        """What a checkpoint keeps: the finished batches not yet trained on and the next batch's index
        (the batch in progress is sampled again after a resume)."""
        with self._cond:
            return {"next_index": self._next_index, "queued": [r.to_json() for r in self._queue]}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- sampler side ------------------------------------------------------------------------------
    def _apply_newest(self, version=None, payload=None) -> None:
        """Serve the newest published weights unless the sampler has them (never while it samples)."""
        if version is None:
            with self._cond:
                if self._published is None:
                    return
                version, payload = self._published
        if version != self._applied_version:
            self.engine.apply(self.sampler, self.adapter_name, payload)
            self._applied_version = version

    def _version_gate_closed(self) -> bool:
        # batch p is trained on after publish p + 1 (the first publish is the starting weights); started
        # after publish c, it is then p + 1 - c versions old: it may start once c >= p + 1 - max_staleness
        return self._publishes < self._produced + 1 - self.max_staleness

    def _ready(self) -> bool:
        return not (self._pauses or len(self._queue) >= self.queue_size or self._version_gate_closed())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    self._cond.wait()
                if self._closed:
                    return
                assert self._published is not None  # _ready() waits for the first publish
                index, (version, payload) = self._next_index, self._published  # the newest, taken with the lock
                self._sampling, self._busy_since = True, time.perf_counter()
            try:
                self._apply_newest(version, payload)
                rollout = self.sample(index)
                rollout.meta["batch_index"] = index
            except BaseException as e:
                rollout, failure = None, e
            else:
                failure = None
            with self._cond:
                self._sampling = False
                self._sampler_busy += time.perf_counter() - self._busy_since
                self._busy_since = None
                if failure is not None or rollout is None:
                    self._error = failure
                else:
                    self._queue.append(rollout)
                    self._next_index, self._produced = index + 1, self._produced + 1
                self._cond.notify_all()
                if failure is not None:
                    return
