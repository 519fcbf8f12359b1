"""RL checkpoints that resume as if the run had never stopped.

A checkpoint is the model's own (twinkle.model.checkpoint: the PEFT adapter, optimizer, scheduler and
the process's python / numpy / torch RNG streams) plus `rl_state.json`: the step, the policy version
the sampler was serving, the rollout producer's queue (finished batches not yet trained on, and the
next batch's index), the advantage and reward state, and whatever the loop adds (`extra`).

What the loop draws at random it draws by a rule of (run seed, batch index): `batch_rng(seed, b)`
gives batch b's prompts and its sampling seed, so a resumed run draws the same batches without
replaying any stream, whatever process the sampler lives in. Saving writes a `.partial` folder and
renames it into place, so a process killed mid-save (kill -9) leaves the previous checkpoint as the
latest one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

RL_STATE = "rl_state.json"
PREFIX, PARTIAL = "step-", ".partial"


def batch_rng(seed: int, index: int) -> random.Random:
    """The random stream of batch `index` of run `seed` (independent of every other batch)."""
    return random.Random(f"twinkle-rl/{seed}/{index}")


@dataclass
class RLState:
    step: int = 0  # batches trained on (optimizer steps)
    policy_version: int = 0  # the version the sampler served after that step
    producer: dict | None = None  # RolloutProducer.state(); None in a synchronous loop
    advantage: dict = field(default_factory=dict)
    reward: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def save_rl_checkpoint(root, model, adapter_name: str, state: RLState, keep: int = 2) -> Path:
    """`root/step-NNNNNN`: the model's adapter with training state, and `state`; the `keep` newest stay."""
    root = Path(root)
    final = root / f"{PREFIX}{state.step:06d}"
    staging = final.with_name(final.name + PARTIAL)
    shutil.rmtree(staging, ignore_errors=True)
    model.save(str(staging), adapter_name=adapter_name, save_training_state=True, data_position=state.step)
    (staging / RL_STATE).write_text(json.dumps(asdict(state)))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_rl_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under `root` (None: there is none yet)."""
    found = _complete(Path(root)) if Path(root).is_dir() else []
    return found[-1] if found else None


def load_rl_checkpoint(path, model, adapter_name: str, engine=None) -> RLState:
    """Restore the model (weights, optimizer, scheduler, RNG streams) and return the RL state. With
    `engine`, its next publish of `adapter_name` is numbered `policy_version` again: the resumed
    sampler serves the saved weights under the version the saved run's sampler had."""
    path = Path(path)
    if not (path / RL_STATE).is_file():
        raise FileNotFoundError(f"{path} is not an RL checkpoint: {RL_STATE} is missing")
    model.resume_from_checkpoint(str(path), adapter_name=adapter_name)
    state = RLState(**json.loads((path / RL_STATE).read_text()))
    if engine is not None:
        engine.versions[adapter_name] = state.policy_version - 1
    return state


def _complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{PREFIX}*") if not p.name.endswith(PARTIAL) and (p / RL_STATE).is_file())
