"""Self-hosted Tinker serving: twinkle-server against SkyRL's Tinker server, the same SDK script on both.

SkyRL (PyPI `skyrl` 0.4.0, `-m skyrl.tinker.api`, JAX backend on CPU) runs from a uv project of its
own under out/peer-venvs/ on Python 3.12, as its docs start it (`uv run ... -m skyrl.tinker.api`: it
starts its engine process with the same `uv run` flags, so it cannot run from a plain venv).
twinkle-server runs as users run it (benchmarks/_server.py). Both serve the embedded demo model's
folder: SkyRL takes a local HF folder as `--base-model` (skyrl.tx.utils.models.resolve_model_path
uses a directory as is). The client side is this venv's tinker SDK (uv.lock's, 0.38), unmodified,
the same code for both servers (bench_serve_tinker.SdkTenant: LoRA rank 16, forward_backward with
cross_entropy on B x T tokens, then AdamW optim_step, both submitted before either is awaited).

Measured per server: time from creating the client to the end of its first step (a fresh server,
right after it reports healthy, so it includes what each still does then: SkyRL loads the model in
its engine process and JIT-compiles the step), steps/s for one tenant, and the aggregate steps/s of
four tenants at once (four clients in threads). The two servers alternate round by round. One
sampling call per server (save_weights_and_get_sampling_client, then sample) records what fails,
as it fails. Both servers have the machine's cores (JAX/XLA and torch threads see the same 2).

Not matched, by design of the tools: SkyRL fixes LoRA alpha at 32 for every rank (Twinkle's server
uses its own default alpha for rank 16); SkyRL's JAX model is its own Qwen3 port, not transformers';
SkyRL 0.4.0's `tinker` extra misses `aiohttp`, which its API imports, so the peer project adds it.

    uv run python benchmarks/bench_peer_skyrl_serve.py [--steps 6] [--rounds 2] [--batch 8] [--seq 128]

Final line: JSON with `ratio` = twinkle-server / SkyRL aggregate steps/s at four tenants (goal >= 5),
`ratio_1_tenant`, `first_step_ratio` = twinkle's / SkyRL's time to the first step (goal <= 1/20),
the raw numbers and `failures` (each server's errors as text).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
from _peer import find_python, peer_project, uv_env
from _server import start_server
from bench_serve_tinker import SdkTenant, make_batch

os.environ.setdefault("TINKER_TELEMETRY", "0")
SKYRL_PROJECT = """[project]
name = "skyrl-peer"
version = "0"
requires-python = ">=3.12,<3.13"
# aiohttp: imported by skyrl.tinker.api, missing from skyrl 0.4.0's `tinker` extra
dependencies = ["skyrl[tinker,jax]==0.4.0", "aiohttp"]

[project.optional-dependencies]
# SkyRL starts its engine with `uv run <its flags> --extra tinker --extra <backend>`
tinker = []
jax = []

[tool.uv]
package = false
"""


def start_skyrl(model_dir: str, python: str) -> tuple[subprocess.Popen, str]:
    from twinkle.serve import free_port

    project = peer_project("skyrl", SKYRL_PROJECT, python)
    data = Path(tempfile.mkdtemp(prefix="bench-skyrl-"))
    port = free_port()
    backend = {"max_lora_adapters": 8, "max_lora_rank": 16}
    cmd = ["uv", "run", "--frozen", "--project", str(project), "-m", "skyrl.tinker.api", "--base-model", model_dir]
    cmd += ["--backend", "jax", "--backend-config", json.dumps(backend), "--checkpoints-base", str(data / "ckpt")]
    cmd += ["--database-url", f"sqlite:///{data / 'tinker.db'}", "--host", "127.0.0.1", "--port", str(port)]
    log = open(data / "server.log", "w")  # noqa: SIM115 - the child process writes to it after this returns
    proc = subprocess.Popen(cmd, cwd=project, env=uv_env(UV_PYTHON=python), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"SkyRL server exited with {proc.returncode}: {(data / 'server.log').read_text()[-2000:]}"
            )
        try:
            if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("SkyRL server did not become healthy within 600 s")


def four_at_once(tenants: list[SdkTenant], steps: int) -> float:
    barrier, spans = threading.Barrier(len(tenants)), [0.0] * len(tenants)

    def run(i):
        spans[i] = tenants[i].seconds(steps, barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(tenants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(spans)  # the tenants' aggregate, over the slowest one's window


def try_sampling(tenant: SdkTenant) -> str | None:
    """None when a sample comes back, else the error as the SDK raised it."""
    types = tenant.types
    try:
        sampler = tenant.tc.save_weights_and_get_sampling_client(name="bench-sample")
        sampler = sampler.result() if hasattr(sampler, "result") else sampler  # SDK 0.38 returns a future
        prompt = types.ModelInput.from_ints(tenant.data[0].model_input.to_ints()[:16])
        sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4)).result()
        return None
    except Exception as e:  # recorded, not raised: what fails is part of the result
        return f"{type(e).__name__}: {e}"[:400]


class Side:
    """One server with its tenants; every failure is kept as text instead of ending the run."""

    def __init__(self, name, url, keys, model, rows):
        self.name, self.failures = name, {}
        t0 = time.perf_counter()
        self.tenants = [self._guard("first step", lambda: SdkTenant(url, keys[0], model, rows))]
        self.first_step_s = time.perf_counter() - t0 if self.tenants[0] else None
        for key in keys[1:]:
            self.tenants.append(self._guard("create tenants 2-4", lambda k=key: SdkTenant(url, k, model, rows)))
        self.seconds = {"1": 0.0, "4": 0.0}

    def _guard(self, what, fn):
        try:
            return fn()
        except Exception as e:
            self.failures.setdefault(what, f"{type(e).__name__}: {e}"[:400])
            return None

    def round(self, steps):
        if self.tenants[0]:
            self.seconds["1"] += self._guard("1 tenant", lambda: self.tenants[0].seconds(steps)) or 0.0
        if all(self.tenants):
            self.seconds["4"] += self._guard("4 tenants", lambda: four_at_once(self.tenants, steps)) or 0.0


def main():
    from twinkle.hub import DEFAULT_MODEL, resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per tenant per round")
    ap.add_argument("--rounds", type=int, default=2, help="the two servers alternate this many times")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")  # both servers inherit it
    model_dir = str(resolve_model_path(DEFAULT_MODEL))
    python = find_python("3.12")
    procs = []
    try:
        sky_proc, sky_url = start_skyrl(model_dir, python)
        procs.append(sky_proc)
        tw_proc, tw_url, keys = start_server(DEFAULT_MODEL, 4)
        procs.append(tw_proc)
        from transformers import AutoConfig

        rows = make_batch(args.batch, args.seq, AutoConfig.from_pretrained(model_dir).vocab_size, 0)
        sides = [
            Side("skyrl", sky_url, ["tml-bench"] * 4, model_dir, rows),
            Side("twinkle", tw_url, keys, DEFAULT_MODEL, rows),
        ]
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:
                side.round(args.steps)
                print(f"round {i} {side.name}: {side.seconds} failures {side.failures}", flush=True)
        for side in sides:
            if side.tenants[0]:
                side.failures["sampling"] = try_sampling(side.tenants[0])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    steps = args.steps * args.rounds
    out = {}
    for side in sides:
        out[f"{side.name}_steps_per_s"] = steps / side.seconds["1"] if side.seconds["1"] else None
        out[f"{side.name}_4_tenants_steps_per_s"] = 4 * steps / side.seconds["4"] if side.seconds["4"] else None
        out[f"{side.name}_first_step_s"] = side.first_step_s
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    result = {
        "ratio": ratio(out["twinkle_4_tenants_steps_per_s"], out["skyrl_4_tenants_steps_per_s"]),
        "ratio_1_tenant": ratio(out["twinkle_steps_per_s"], out["skyrl_steps_per_s"]),
        "first_step_ratio": ratio(out["twinkle_first_step_s"], out["skyrl_first_step_s"]),
        **out,
        "failures": {side.name: {k: v for k, v in side.failures.items() if v} for side in sides},
        "peer": "skyrl==0.4.0 (jax, cpu)",
        "model": DEFAULT_MODEL,
        "batch": args.batch,
        "seq": args.seq,
        "steps_per_tenant": steps,
        "load_avg": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
