"""The reliability load: 8 tenants, half through the unmodified Tinker SDK and half through Twinkle's
native client, each training 100 steps on the test preset (pipelined), sampling half-way, and
saving a checkpoint with its optimizer state at the end (and every few steps when asked).

Each tenant's training is a pure function of its index: the LoRA seed, every step's batch and the
learning rate, so the same tenant trained alone on a fresh server is the reference it must equal.
Shared by the load test (concurrent vs alone) and the crash test (the same load under kill -9).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEPS = 100
WINDOW = 4  # steps submitted ahead of the oldest unanswered one: seq ids must keep them in order
# Small enough that training is not chaotic: at 1e-2 on these random tokens a fused pass's 1e-6
# rounding difference grows ~2.5x a step (0.4 in the adapter after 100 steps, measured); at 1e-3 the
# final adapters agree to ~1e-7, so "equals alone" tests ordering and isolation, not the weather.
LR = 1e-3
RANK = 4
RESULT_TIMEOUT_S = 120


def mixed_tenants(n: int, prefix: str = "load") -> list[tuple[str, str]]:
    """n tenants as (name, client), alternating the Tinker SDK and the native client."""
    return [(f"{prefix}{i}", "sdk" if i % 2 == 0 else "native") for i in range(n)]


TENANTS = mixed_tenants(8)


def step_tokens(index: int, step: int) -> list[list[int]]:
    """Tenant `index`'s batch for `step`: two short random sequences (tiny, so 100 steps are cheap)."""
    rng = np.random.default_rng(1000 * index + step)
    return [rng.integers(9, 800, size=int(rng.integers(8, 14))).tolist() for _ in range(2)]


def folder_of(data_dir: Path, tenant: str, path: str) -> Path:
    """Where the server keeps tinker://{model_id}/weights/{name} for `tenant`."""
    model_id, _, name = path[len("tinker://") :].split("/")
    return data_dir / "tenants" / tenant / model_id.replace(":", "_") / "weights" / name


def files_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def checkpoint_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every number a checkpoint holds: adapter, optimizer, scheduler and counters (the training state
    of twinkle.model.checkpoint, flattened; the saving process's RNG left out), by name."""
    import json

    from safetensors.numpy import load_file

    out = {f"adapter/{k}": v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
    state = folder / "training_state"
    if not state.is_dir():
        return out
    tensors = load_file(str(state / "state.safetensors"))

    def flatten(prefix, node):
        if isinstance(node, dict) and "tensor" in node:
            out[prefix] = tensors[node["tensor"]]
        elif isinstance(node, dict):
            for k, v in node.items():
                flatten(f"{prefix}/{k}", v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                flatten(f"{prefix}/{i}", v)
        elif node is not None:
            out[prefix] = np.asarray(node)

    skeleton = json.loads((state / "state.json").read_text())
    flatten("state", {k: v for k, v in skeleton.items() if k != "rng"})
    return out


def bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return bool(a) and a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


class SdkClient:
    """One tenant through the unmodified Tinker SDK: cross_entropy + Adam, save_state with optimizer."""

    def __init__(self, url: str, key: str, index: int):
        import tinker

        self.index = index
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self.tc = None

    def open(self, resume: str | None) -> str:
        from twinkle.hub import TEST_MODEL

        if resume is None:
            future = self.service.create_lora_training_client(base_model=TEST_MODEL, rank=RANK, seed=self.index)
        else:  # weights and Adam moments, as the SDK resumes
            future = self.service.create_training_client_from_state_with_optimizer(resume)
        self.tc = future.result(timeout=RESULT_TIMEOUT_S)
        return self.tc.model_id

    def submit_step(self, step: int):
        from tinker import types

        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
            )
            for t in step_tokens(self.index, step)
        ]
        return (
            self.tc.forward_backward(batch, "cross_entropy"),
            self.tc.optim_step(types.AdamParams(learning_rate=LR)),
        )

    def submit_save(self, name: str):
        return self.tc.save_state(name)

    def load(self, path: str):
        import warnings

        with warnings.catch_warnings():  # deprecated in 0.38 but served: one model can load many checkpoints
            warnings.simplefilter("ignore", FutureWarning)
            return self.tc.load_state_with_optimizer(path)

    def result(self, kind: str, future):
        out = future.result(timeout=RESULT_TIMEOUT_S)
        return {"forward_backward": lambda: out.metrics["loss:sum"], "save": lambda: out.path}.get(kind, lambda: out)()

    def sample(self) -> int:
        from tinker import types

        sampler = self.tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        res = sampler.sample(
            types.ModelInput.from_ints([1, 2, 3]),
            2,
            types.SamplingParams(max_tokens=4, seed=self.index, temperature=1.0),
        )
        return len(res.result(timeout=RESULT_TIMEOUT_S).sequences)

    def close(self):
        self.service.close("success").result(timeout=30)


class NativeClient:
    """One tenant through twinkle-client's TransformersModel / Sampler: CrossEntropyLoss + AdamW."""

    def __init__(self, url: str, key: str, index: int):
        from twinkle.client import TwinkleClient

        self.index = index
        self.client = TwinkleClient(url, key, timeout=RESULT_TIMEOUT_S)
        self.model = None

    def open(self, resume: str | None) -> str:
        from twinkle.client.model import TransformersModel
        from twinkle.hub import TEST_MODEL

        self.model = TransformersModel(model_id=TEST_MODEL, client=self.client, seed=self.index)
        if resume is None:
            self.model.add_adapter_to_model("default", {"r": RANK, "lora_alpha": 8, "target_modules": "all-linear"})
            self.model.set_optimizer("AdamW", lr=LR).result(timeout=RESULT_TIMEOUT_S)
        else:  # the adapter from the folder, its optimizer, then weights, AdamW moments and step counters
            self.model.load(resume)
            self.model.set_optimizer("AdamW", lr=LR)
            assert self.model.resume_from_checkpoint(resume).result(timeout=RESULT_TIMEOUT_S)["resumed"]
        self.model.set_loss("CrossEntropyLoss").result(timeout=RESULT_TIMEOUT_S)
        return self.model.model_id

    def submit_step(self, step: int):
        rows = [{"input_ids": t, "labels": t} for t in step_tokens(self.index, step)]
        return self.model.forward_backward(inputs=rows), self.model.clip_grad_and_step()

    def submit_save(self, name: str):
        return self.model.save(name, save_training_state=True)

    def load(self, path: str):
        return self.model.resume_from_checkpoint(path)

    def result(self, kind: str, future):
        out = future.result(timeout=RESULT_TIMEOUT_S)
        return out["loss"] if kind == "forward_backward" else out

    def sample(self) -> int:
        from twinkle.client.sampler import Sampler
        from twinkle.hub import TEST_MODEL

        sampler = Sampler(model_id=TEST_MODEL, client=self.client)
        sampler.add_adapter_from_model("self", self.model)
        out = sampler.sample(
            [[1, 2, 3]], {"max_tokens": 4, "seed": self.index, "num_samples": 2}, adapter_name="self"
        ).result(timeout=RESULT_TIMEOUT_S)
        return len(out[0].sequences)

    def close(self):
        self.client.close()


@dataclass
class Pending:
    kind: str  # forward_backward | optim_step | save
    step: int  # forward_backward/optim_step: the step; save: steps done when it was taken
    t0: float
    future: object


@dataclass
class Ack:
    path: str
    steps: int
    folder: Path
    digest: dict


class TenantRun:
    """One tenant's `steps` steps (STEPS unless told): submitted WINDOW ahead, answered in order, with
    sampling half-way. `checkpoint_every` adds a save (with optimizer) every so many steps; the last one
    is always saved as "final"."""

    def __init__(
        self,
        name: str,
        index: int,
        kind: str,
        url: str,
        key: str,
        data_dir: Path,
        checkpoint_every: int | None = None,
        steps: int = STEPS,
    ):
        self.name, self.index, self.kind, self.data_dir = name, index, kind, Path(data_dir)
        self.steps = steps
        self.url, self.key, self.checkpoint_every = url, key, checkpoint_every
        self.api = (SdkClient if kind == "sdk" else NativeClient)(url, key, index)
        self.losses: dict[int, float] = {}  # step -> its loss (a replay after a crash rewrites the same value)
        self.loss_log: list[tuple[int, float]] = []  # every loss any answer carried, for "never silently wrong"
        self.latencies: list[float] = []  # submit -> optimizer step answered
        self.samples: list[int] = []
        self.acked: list[Ack] = []  # checkpoints the server acknowledged, in order
        self.model_ids: list[str] = []
        self.pending: deque[Pending] = deque()
        self.steps_done = 0
        self.progress = threading.Event()  # set on every answered step (the crash driver waits on it)

    def open(self) -> Ack | None:
        """A model at the last acknowledged checkpoint (or a fresh one); steps continue from there."""
        resume = self.acked[-1] if self.acked else None
        self.model_ids.append(self.api.open(resume.path if resume else None))
        self.steps_done = resume.steps if resume else 0
        return resume

    def run(self) -> None:
        submitted = self.steps_done
        while True:
            while submitted < self.steps and sum(p.kind == "optim_step" for p in self.pending) < WINDOW:
                t0 = time.perf_counter()
                fb, opt = self.api.submit_step(submitted)
                self.pending += [
                    Pending("forward_backward", submitted, t0, fb),
                    Pending("optim_step", submitted, t0, opt),
                ]
                submitted += 1
                if submitted == self.steps or (self.checkpoint_every and submitted % self.checkpoint_every == 0):
                    name = "final" if submitted == self.steps else f"step-{submitted}"
                    self.pending.append(Pending("save", submitted, t0, self.api.submit_save(name)))
                if submitted == self.steps // 2:  # on the weights after half the steps (ordered behind them)
                    self.samples.append(self.api.sample())
            if not self.pending:
                return
            self.settle(self.pending[0])
            self.pending.popleft()

    def settle(self, item: Pending) -> None:
        self.accept(item, self.api.result(item.kind, item.future))

    def accept(self, item: Pending, value, progress: bool = True) -> None:
        if item.kind == "forward_backward":
            self.losses[item.step] = float(value)
            self.loss_log.append((item.step, float(value)))
        elif item.kind == "optim_step":
            self.steps_done = item.step + 1
            self.latencies.append(time.perf_counter() - item.t0)
            if progress:
                self.progress.set()
        else:
            folder = folder_of(self.data_dir, self.name, value)
            self.acked.append(Ack(value, item.step, folder, files_digest(folder)))

    @property
    def final(self) -> Ack:
        return next(a for a in reversed(self.acked) if a.path.endswith("/final"))


def train_all(
    url: str, keys: dict, data_dir: Path, concurrent: bool, tenants: list[tuple[str, str]] = TENANTS, steps: int = STEPS
) -> tuple[dict[str, TenantRun], float]:
    """Every tenant's full run, all at once (threads) or one after another; (runs, wall seconds)."""
    runs = {
        name: TenantRun(name, i, kind, url, keys[name], data_dir, steps=steps) for i, (name, kind) in enumerate(tenants)
    }
    errors = []

    def body(run: TenantRun):
        try:
            run.open()
            run.run()
        except Exception as e:
            errors.append((run.name, repr(e)))
        finally:
            run.api.close()

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in runs.values()]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=900)
        assert not any(th.is_alive() for th in threads), "a tenant did not finish within 900 s"
    else:
        for r in runs.values():
            body(r)
    assert not errors, errors
    return runs, time.perf_counter() - t0


_ALONE: dict = {}


def alone_reference(launch) -> tuple[dict[str, TenantRun], float]:
    """Each tenant trained alone (one at a time) on a fresh server, and the wall time of all of them;
    computed once per session (the load and the crash test compare against the same runs)."""
    if not _ALONE:
        srv, keys = launch([name for name, _ in TENANTS])
        _ALONE["runs"], _ALONE["wall"] = train_all(srv.url, keys, srv.data_dir, concurrent=False)
        srv.stop()
    return _ALONE["runs"], _ALONE["wall"]


def loss_tolerance(reference: dict[str, TenantRun]) -> float:
    """1e-5 relative to the largest loss (Tinker's loss:sum grows with the tokens)."""
    return 1e-5 * max(1.0, max(abs(v) for r in reference.values() for v in r.losses.values()))


def adapter_diff(a: Path, b: Path) -> float:
    from safetensors.numpy import load_file

    x, y = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert x.keys() == y.keys() and x
    return max(float(np.max(np.abs(x[k] - y[k]))) for k in x)


def adapter_rel_diff(a: Path, b: Path) -> float:
    """The largest ||a - b|| / ||b|| over the adapter's tensors. Adam turns a rounding difference in a
    near-zero gradient (fused passes sum in another order) into up to one learning rate of movement in
    that element: at 32 tenants a few dozen elements of a tensor differ by ~1e-4 (1e-3 of its norm)
    while losses agree to 1e-5. A leaked, skipped or repeated update moves whole tensors."""
    from safetensors.numpy import load_file

    x, y = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert x.keys() == y.keys() and x
    return max(float(np.linalg.norm(x[k] - y[k]) / max(np.linalg.norm(y[k]), 1e-12)) for k in x)
