"""Crash-exact RL resume through the server: examples/tinker_grpo_resume.py (GRPO written against the
unmodified Tinker SDK: seeded sampling on a fresh snapshot each step, importance_sampling, Adam, a
checkpoint every 2 steps) is `kill -9`ed -- the client once, then the real server -- at seeded random
points, resumed with `--resume`, and its final checkpoint equals an uninterrupted run's bit for bit:
every adapter tensor and every number of the optimizer state. Beside it, a seeded sample repeats to the
bit on a warm prefix cache and after the restart (an empty one).

Bit-exact, not a tolerance: the runs use one server alone (no other tenant's rows fused into their
passes), so the same kernels run on the same shapes in the same order, and any difference is state
a checkpoint lost (optimizer moments or step count, the data position, the shuffling RNG, a sampling
seed) or sampling that is not a function of its request (a server restart empties every cache).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from _load_tenants import bit_equal, checkpoint_tensors, folder_of
from harness import SUMMARY, server_env

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "tinker_grpo_resume.py"
STEPS, EVERY = 8, 2
TENANT = "grpo"


def client(srv, key: str, ckpt: Path, resume: bool = False) -> subprocess.Popen:
    from twinkle.hub import TEST_MODEL

    env = {**server_env(), "TINKER_BASE_URL": srv.url, "TINKER_API_KEY": key}  # bytecode cached: ~2 s less a start
    args = ["--model", TEST_MODEL, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--seed", "5"]
    args += ["--prompts", "2", "--group", "4", "--max-tokens", "4", "--lr", "1e-3"]
    args += ["--dataset-size", "6"]  # a new epoch, reshuffled by the saved RNG, every 3 steps
    args += ["--checkpoint-dir", str(ckpt), *(["--resume"] if resume else [])]
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    """-> (the final checkpoint's path, the output)."""
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    return re.search(r"^final: (\S+)$", out, re.M)[1], out


def until_step(proc: subprocess.Popen, step: int, delay: float) -> None:
    """Read the client's output until it reports `step`, then wait `delay` s (mid-step or mid-checkpoint)."""
    marker = f"step {step}: reward"
    if not any(line.startswith(marker) for line in iter(proc.stdout.readline, "")):
        raise AssertionError(f"the client ended before step {step} (exit {proc.wait()})")
    time.sleep(delay)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()


def resumed_from(out: str) -> int:
    """The step a resumed run continued from (0: it had no checkpoint yet and started afresh)."""
    found = re.search(r"^resumed from step (\d+)", out, re.M)
    return int(found[1]) if found else 0


def seeded_draws(srv, key: str) -> list:
    """The same seeded sample twice on the base model (the second finds the first's prefix cached): each
    sequence's tokens and log-probs."""
    import tinker
    from tinker import types

    from twinkle.hub import TEST_MODEL

    with tinker.ServiceClient(base_url=srv.url, api_key=key) as service:
        sampler = service.create_sampling_client(base_model=TEST_MODEL).result()
        prompt = types.ModelInput.from_ints(list(range(5, 29)))
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=46)
        return [[(s.tokens, s.logprobs) for s in sampler.sample(prompt, 3, params).result().sequences] for _ in "ab"]


def test_grpo_killed_client_then_server_resumes_bit_identical(launch, tmp_path):
    srv, keys = launch([TENANT])
    key = keys[TENANT]
    rng = random.Random(46)
    t0 = time.perf_counter()
    plain, _ = finish(client(srv, key, tmp_path / "plain"))
    before = seeded_draws(srv, key)

    # the client killed at a random point after its first checkpoint, resumed from its newest complete one
    at = rng.randint(EVERY, STEPS - 3)
    crashing = client(srv, key, tmp_path / "client-crash")
    until_step(crashing, at, rng.uniform(0.0, 0.1))
    kill9(crashing)
    after_client, out = finish(client(srv, key, tmp_path / "client-crash", resume=True))
    client_from = resumed_from(out)
    assert max(EVERY, at + 1 - EVERY) <= client_from < STEPS, out[-2000:]  # the kill cut the run short

    # the server killed at a random point (the user's script dies with it), restarted on its data dir
    at_server = rng.randint(EVERY, STEPS - 3)
    victim = client(srv, key, tmp_path / "server-crash")
    until_step(victim, at_server, rng.uniform(0.0, 0.1))
    srv.kill9()
    kill9(victim)
    srv.start()
    # seeded sampling repeats to the bit on a warm cache and after a restart (an empty one): the
    # behaviour log-probs a replayed step trains on are the lost step's
    assert seeded_draws(srv, key) == before and before[0] == before[1]
    after_server, out = finish(client(srv, key, tmp_path / "server-crash", resume=True))
    server_from = resumed_from(out)
    assert max(EVERY, at_server + 1 - EVERY) <= server_from < STEPS, out[-2000:]
    wall = time.perf_counter() - t0

    want = checkpoint_tensors(folder_of(srv.data_dir, TENANT, plain))
    assert any(v.any() for k, v in want.items() if "lora_B" in k)  # it trained
    assert any(k.startswith("state/") for k in want)  # the optimizer's state is compared too
    for label, path in (("client", after_client), ("server", after_server)):
        got = checkpoint_tensors(folder_of(srv.data_dir, TENANT, path))
        differ = sorted(k for k in want if k not in got or not (got[k] == want[k]).all())
        assert bit_equal(got, want), f"after the {label} kill: {len(differ)} of {len(want)} differ, e.g. {differ[:4]}"
    print(
        f"\nGRPO through the SDK, {STEPS} steps: client kill -9 after step {at} (resumed from {client_from}), "
        f"server kill -9 after step {at_server} (resumed from {server_from}); both end bit-identical to the "
        "uninterrupted run "
        f"({len(want)} adapter and optimizer tensors); {wall:.0f} s"
    )
    SUMMARY["RL resume through the server (kill -9 client, server)"] = f"bit-identical final state, {len(want)} tensors"
