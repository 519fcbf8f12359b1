"""DataLoader: global batches in a seeded order, each data rank yielding its own slice.

Every rank walks the same global order and reads the whole global batch, so when a bad sample is
skipped all ranks skip it alike and their slices never overlap, with no communication. The state is
(epoch, position in the epoch's order): resuming continues at exactly the next unseen sample.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import TYPE_CHECKING, cast

import numpy as np

from twinkle.dataloader.mesh import check_remote_group, resolve_mesh, slice_for_rank
from twinkle.dataset.dataset import ERROR_KEY
from twinkle.dataset.errors import DataError

if TYPE_CHECKING:
    from twinkle.dataloader.mesh import DataRanks

logger = logging.getLogger(__name__)
STATE_VERSION = 1


def default_check(row: object) -> str | None:
    """Why a row cannot be trained on, or None when it can."""
    if not isinstance(row, dict):
        return f"expected a dict row, got {type(row).__name__}"
    if ERROR_KEY in row:
        return row[ERROR_KEY]
    if "input_ids" in row and not row["input_ids"]:
        return "empty input_ids"
    if row.get("labels") is not None and all(t == -100 for t in row["labels"]):
        return "no token carries loss (every label is -100)"
    return None


class DataLoader:
    """Iterate ``dataset`` in global batches of ``batch_size`` rows; yields this data rank's rows.

    min_batch_size: a last, short global batch is kept only if it has at least this many rows
        (default: one per data rank); it is trimmed to a multiple of the data world size.
    device_mesh: a ``twinkle.mesh.DeviceMesh`` (or anything with ``data_rank`` / ``data_world_size``);
        default: the global mesh, else a single rank.
    max_retries: consecutive bad samples tolerated before giving up with their reasons.
    check: ``row -> reason | None``; a row with a reason is skipped and the reason logged.
    dataset: a dataset, or a function that builds one (twinkle-kit passes a factory), called here.
    num_workers: twinkle-kit's worker processes; rows are read here, so only 0 is accepted.
    remote_group: twinkle-kit's placement of the loader; in ray mode the driver reads the data and the
        model's group splits each batch, so it must name a DeviceGroup that exists, and changes nothing else.
    """

    def __init__(
        self,
        dataset: Iterable[dict] | Callable[[], Iterable[dict]],
        batch_size: int,
        min_batch_size: int | None = None,
        device_mesh: DataRanks | None = None,
        shuffle: bool = True,
        seed: int = 0,
        max_retries: int = 16,
        shuffle_buffer: int = 1024,
        check: Callable[[dict], str | None] = default_check,
        *,
        remote_group: str | None = None,
        num_workers: int = 0,
    ) -> None:
        if num_workers:
            raise NotImplementedError(
                f"num_workers={num_workers}: this DataLoader reads rows in its own process (encode the dataset "
                "beforehand, or stream it); pass num_workers=0"
            )
        rows = dataset() if callable(dataset) and not isinstance(dataset, Iterable) else dataset
        check_remote_group(remote_group)
        self.dataset: Iterable[dict] = rows
        self.mesh = resolve_mesh(device_mesh)
        world = self.mesh.data_world_size
        if batch_size < 1 or batch_size % world:
            raise ValueError(f"batch_size={batch_size} must be a positive multiple of the data world size {world}")
        self.batch_size = batch_size
        self.min_batch_size = max(min_batch_size or world, world)
        self.shuffle = shuffle
        self.seed = seed
        self.max_retries = max_retries
        self.shuffle_buffer = shuffle_buffer
        self.check = check
        self.epoch = 0
        self.position = 0  # rows of this epoch's order consumed, bad ones included
        self.skipped: list[tuple[int, str]] = []  # (position, reason), this process's record
        try:
            self._length = len(rows) if isinstance(rows, Sized) else None
        except TypeError:  # a Dataset over a stream says so
            self._length = None  # streamed: no random access

    # ---- order ---------------------------------------------------------------------------------
    def _order(self, length: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(length)
        return np.random.default_rng([self.seed, self.epoch]).permutation(length)

    def _stream_order(self) -> Iterator[tuple[int, dict]]:
        """(position, row) from a streamed dataset: a seeded shuffle buffer, replayed from the start on
        resume (the buffer itself is never saved, so the same seed must rebuild it)."""
        rows = iter(self.dataset)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch])
            rows = _buffer_shuffle(rows, self.shuffle_buffer, rng)
        return enumerate(rows)

    def _fetch(self, position: int, index: int | None, row: dict | None = None) -> dict | None:
        try:
            if row is None:
                assert index is not None, "a row by index comes from a dataset with random access"
                row = cast("Sequence[dict]", self.dataset)[int(index)]  # random access: it has a length
            reason = self.check(row)
        except (DataError, KeyError, ValueError, TypeError, IndexError) as e:
            reason = f"{type(e).__name__}: {e}"
        if reason is None:
            return row
        where = f"sample {index}" if index is not None else f"streamed sample {position}"
        logger.warning("skipping %s (epoch %d): %s", where, self.epoch, reason)
        self.skipped.append((position, reason))
        return None

    def _global_batches(self) -> Iterator[list]:
        if self._length is not None:
            order = self._order(self._length)
            source = ((p, int(order[p]), None) for p in range(self.position, self._length))
        else:
            source = ((p, None, row) for p, row in itertools.islice(self._stream_order(), self.position, None))
        batch, bad_run = [], []
        position = self.position - 1
        for position, index, row in source:
            good = self._fetch(position, index, row)
            if good is None:
                bad_run.append(self.skipped[-1][1])
                if len(bad_run) > self.max_retries:
                    raise DataError(
                        f"{len(bad_run)} bad samples in a row (max_retries={self.max_retries}); "
                        f"last reasons: {bad_run[-3:]}"
                    )
            else:
                bad_run = []
                batch.append(good)
            if len(batch) == self.batch_size:
                self.position = position + 1
                yield batch
                batch = []
        self.position = position + 1  # the epoch is read to its end
        keep = len(batch) - len(batch) % self.mesh.data_world_size
        if keep and keep >= self.min_batch_size:
            yield batch[:keep]

    def __iter__(self) -> Iterator[list[dict]]:
        """One epoch from the current position; the next ``for`` starts the next epoch."""
        for global_batch in self._global_batches():
            yield slice_for_rank(self.mesh, global_batch)
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        """Global batches per epoch (bad samples, found only while reading, are not foreseen)."""
        if self._length is None:
            raise TypeError("a streamed DataLoader has no length")
        full, rest = divmod(self._length, self.batch_size)
        rest -= rest % self.mesh.data_world_size
        return full + (1 if rest and rest >= self.min_batch_size else 0)

    # ---- resume --------------------------------------------------------------------------------
    def get_state(self) -> dict:
        """twinkle-kit's progress record: ``consumed_train_samples`` (rows of the seeded order read in
        all epochs so far, bad ones included) beside our ``state_dict``."""
        done = self.epoch * self._length if self._length is not None else 0
        return {"consumed_train_samples": done + self.position, **self.state_dict()}

    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Continue after ``consumed_train_samples`` rows (what ``get_state`` reported when the model was
        saved): the same seeded order, from the next unseen row."""
        if isinstance(consumed_train_samples, bool) or not isinstance(consumed_train_samples, int):
            raise TypeError(f"consumed_train_samples must be an int, got {consumed_train_samples!r}")
        if consumed_train_samples < 0:
            raise ValueError(f"consumed_train_samples must be >= 0, got {consumed_train_samples}")
        if self._length is None:
            self.epoch, self.position = 0, consumed_train_samples
        elif self._length:
            self.epoch, self.position = divmod(consumed_train_samples, self._length)

    skip_consumed_samples = resume_from_checkpoint  # twinkle-kit's other name for it

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "dataset_length": self._length,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "shuffle", "batch_size", "dataset_length"):
            if state.get(key) != getattr(self, "_length" if key == "dataset_length" else key):
                raise ValueError(
                    f"cannot resume: saved {key}={state.get(key)!r} differs from this loader's "
                    f"{getattr(self, '_length' if key == 'dataset_length' else key)!r}"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def _buffer_shuffle(rows: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    buffer = list(itertools.islice(rows, size))
    for row in rows:
        i = int(rng.integers(len(buffer)))
        yield buffer[i]
        buffer[i] = row
    rng.shuffle(buffer)
    yield from buffer
