"""GRPO with routing replay on a MoE model, in the shape of twinkle-kit's cookbook
rl/grpo/short_math_grpo_routing_replay.py (written for this suite): settings through twinkle.cli, a
policy group (TransformersModel, native_fsdp, routing replay) beside a vLLM sampler group, the LoRA synced
to the sampler every batch, a group of completions per GSM8K prompt, rewards, group advantages, the old
policy's log-probs recomputed with the routing recorded (R2) or taken from the sampler (R3), then policy
steps that replay that routing.
"""

import copy
import re
from typing import Any, Dict, List, Tuple

from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh, get_device_placement, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import GRPOMetric
from twinkle.model import TransformersModel
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.processor import InputProcessor
from twinkle.reward import GSM8KAccuracyReward
from twinkle.reward.base import Reward
from twinkle.sampler import vLLMSampler

logger = get_logger()
args = CLI.from_args()

MODEL_ID = args.model.model_id or "ms://Qwen/Qwen3.6-35B-A3B"
USE_MEGATRON = args.model.strategy != "native_fsdp"
ROUTER_REPLAY_MODE = args.rl.router_replay_mode or "R3"

MODEL_GPUS = args.infra.model_gpus or 4
MODEL_FSDP = args.infra.fsdp_size or 4
MODEL_DP = args.infra.dp_size or 1
MODEL_EP = args.infra.ep_size or 4
MODEL_TP = args.infra.tp_size or 1
MODEL_PP = args.infra.pp_size or 1
SAMPLER_GPUS = args.infra.sampler_gpus or 2
SAMPLER_TP = args.sampler.tensor_parallel_size or 2

NUM_GENERATIONS = args.rl.num_generations or 8
MAX_NEW_TOKENS = args.sampling.max_tokens or 4096
LEARNING_RATE = args.optimizer.learning_rate or 5e-5
MAX_STEPS = args.training.max_steps or 1000
BATCH_SIZE = args.training.batch_size or 4
MINI_BATCH_SIZE = args.training.mini_batch_size or 4
MICRO_BATCH_SIZE = args.training.micro_batch_size or 1
GRAD_ACCUM = args.training.gradient_accumulation_steps or 1
ADAPTER_NAME = args.lora.adapter_name or "default"
SAVE_STEPS = args.training.save_steps or 1000
LORA_RANK = args.lora.lora_r or 16

SYSTEM_PROMPT = "Solve the math problem briefly and give the final answer within \\boxed{}."

if ROUTER_REPLAY_MODE not in ("disabled", "R2", "R3"):
    raise ValueError(f"router_replay_mode must be 'disabled', 'R2' or 'R3', got {ROUTER_REPLAY_MODE!r}")
if ROUTER_REPLAY_MODE != "disabled" and USE_MEGATRON:
    raise ValueError("routing replay needs --strategy native_fsdp (the FSDP path only)")
logger.info(f"routing replay mode {ROUTER_REPLAY_MODE}")


class BrevityReward(Reward):
    """0 without a boxed or #### answer; otherwise 1 up to 200 characters, then less the longer it runs."""

    def __call__(self, trajectories: List[Dict[str, Any]], **kwargs) -> List[float]:
        scores = []
        for trajectory in trajectories:
            answer = next(
                (
                    m.get("content", "")
                    for m in reversed(trajectory.get("messages", []))
                    if m.get("role") == "assistant"
                ),
                "",
            )
            if not (re.search(r"\\boxed\{[^}]+\}", answer) or re.search(r"####\s*[-\d,.]+", answer)):
                scores.append(0.0)
            else:
                scores.append(1.0 if len(answer) <= 200 else max(0.0, 1.0 - (len(answer) - 200) / 3000))
        return scores


def gsm8k_dataset():
    dataset = Dataset(DatasetMeta("ms://modelscope/gsm8k", subset_name="main", split="train"))
    dataset.set_template(
        "Qwen3_5Template", model_id=MODEL_ID, max_length=4096, truncation_strategy="delete", enable_thinking=False
    )
    dataset.map(GSM8KProcessor(system=SYSTEM_PROMPT))
    dataset.encode(add_generation_prompt=True)
    return dataset


def score(trajectories: List[Dict[str, Any]]) -> Tuple[List[float], List[float], List[float]]:
    accuracy = GSM8KAccuracyReward()(trajectories)
    brevity = BrevityReward()(trajectories)
    return [a + b for a, b in zip(accuracy, brevity)], brevity, accuracy


def main():
    groups = [
        DeviceGroup(name="model", ranks=list(range(MODEL_GPUS)), device_type="GPU"),
        DeviceGroup(
            name="sampler",
            ranks=list(range(MODEL_GPUS, MODEL_GPUS + SAMPLER_GPUS)),
            device_type="GPU",
            gpus_per_worker=SAMPLER_TP,
        ),
    ]
    if USE_MEGATRON:
        model_mesh = DeviceMesh.from_sizes(
            world_size=MODEL_GPUS,
            dp_size=MODEL_GPUS // (MODEL_TP * MODEL_PP),
            tp_size=MODEL_TP,
            pp_size=MODEL_PP,
            ep_size=MODEL_EP,
            sequence_parallel=True,
        )
    else:
        model_mesh = DeviceMesh.from_sizes(fsdp_size=MODEL_FSDP, dp_size=MODEL_DP, ep_size=MODEL_EP)
    sampler_mesh = DeviceMesh.from_sizes(
        world_size=SAMPLER_GPUS, dp_size=SAMPLER_GPUS // SAMPLER_TP, tp_size=SAMPLER_TP
    )
    twinkle.initialize(mode="ray", nproc_per_node=MODEL_GPUS + SAMPLER_GPUS, groups=groups, lazy_collect=False)

    expert_parallel = MODEL_EP > 1
    lora = dict(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear")
    if expert_parallel and not USE_MEGATRON:  # the experts' 3-D weights get their own LoRA
        lora["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora_config = LoraConfig(**lora)

    if USE_MEGATRON:
        from twinkle.model.megatron import MegatronModel

        model = MegatronModel(model_id=MODEL_ID, device_mesh=model_mesh, remote_group="model", mixed_precision="bf16")
    else:
        model = TransformersModel(
            model_id=MODEL_ID,
            device_mesh=model_mesh,
            remote_group="model",
            enable_router_replay=ROUTER_REPLAY_MODE != "disabled",
            strategy="native_fsdp",
            fsdp_config={
                "expert_parallel": {"enabled": expert_parallel, "router_dtype": "fp32", "keep_router_logits": False}
            },
        )
    model.add_adapter_to_model(ADAPTER_NAME, lora_config, gradient_accumulation_steps=GRAD_ACCUM)
    if USE_MEGATRON:
        model.set_optimizer("default", lr=LEARNING_RATE)
        model.set_lr_scheduler("default", lr_decay_steps=MAX_STEPS, max_lr=LEARNING_RATE)
    else:
        model.set_optimizer("AdamW", lr=LEARNING_RATE)
        model.set_lr_scheduler("CosineAnnealingLR", T_max=MAX_STEPS, eta_min=0)
    model.set_loss("GRPOLoss", epsilon=0.2)
    model.set_processor(InputProcessor)
    model.set_template("Qwen3_5Template", model_id=MODEL_ID, enable_thinking=False)

    engine_args = {
        "tensor_parallel_size": SAMPLER_TP,
        "gpu_memory_utilization": 0.7,
        "max_model_len": 10000,
        "max_lora_rank": LORA_RANK,
        "enable_lora": True,
        "enable_tower_connector_lora": True,
    }
    if ROUTER_REPLAY_MODE == "R3":  # the sampler hands back each token's routed experts
        engine_args["enable_return_routed_experts"] = True
    sampler = vLLMSampler(model_id=MODEL_ID, engine_args=engine_args, device_mesh=sampler_mesh, remote_group="sampler")
    sampler.set_template("Qwen3_5Template", model_id=MODEL_ID, enable_thinking=False)
    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)

    dataloader = DataLoader(
        dataset=gsm8k_dataset,
        batch_size=BATCH_SIZE * GRAD_ACCUM,
        min_batch_size=BATCH_SIZE * GRAD_ACCUM,
        device_mesh=model_mesh,
        remote_group="model",
    )
    advantage_fn = GRPOAdvantage()
    metrics = GRPOMetric()
    sampling_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, num_samples=1, logprobs=1, temperature=1.0, top_p=0.95)
    replay_record = {"R2": RouterReplayAction.RECORD, "R3": RouterReplayAction.REPLAY_FORWARD}.get(ROUTER_REPLAY_MODE)
    logger.info(get_device_placement())

    step = 0
    for batch in dataloader:
        if step >= MAX_STEPS:
            break
        metrics.reset()
        prompts = [prompt for prompt in batch for _ in range(NUM_GENERATIONS)]
        ckpt_manager.sync_weights(merge_and_sync=False)  # the LoRA alone goes to the sampler
        sampler.reset_prefix_cache()
        responses = sampler.sample(prompts, sampling_params)
        if responses and responses[0].sequences:
            logger.info("[sample_debug] first_generation=%r", (responses[0].sequences[0].decoded or "")[:512])

        rows, old_logps = [], []
        for response in responses:
            for sequence in response.sequences:
                rows.append(sequence.new_input_feature)
                old_logps.append([pairs[0][1] for pairs in sequence.logprobs])
        rewards, _, _ = score(rows)
        advantages = advantage_fn(rewards, num_generations=NUM_GENERATIONS, scale="group").tolist()
        logger.info(f"rewards {rewards}")

        # the old policy under this batch's routing: R2 records it, R3 replays what the sampler chose
        for start in range(0, len(rows), MINI_BATCH_SIZE):
            chunk = rows[start : start + MINI_BATCH_SIZE]
            out = model.forward_only(
                inputs=copy.deepcopy(chunk), router_replay_action=replay_record, micro_batch_size=MICRO_BATCH_SIZE
            )
            recomputed = out.get("logps")
            assert recomputed.shape[0] == len(chunk)
            routed = out.get("routed_experts")
            for i, row in enumerate(chunk):
                row["old_logps"] = recomputed[i]
                if routed is not None:
                    row["routed_experts"] = routed[i]

        for start in range(0, len(rows), MINI_BATCH_SIZE):
            chunk = rows[start : start + MINI_BATCH_SIZE]
            for row in chunk:
                row.pop("old_logps", None)
            chunk_old = old_logps[start : start + MINI_BATCH_SIZE]
            chunk_adv = advantages[start : start + MINI_BATCH_SIZE]
            out = model.forward_backward(
                inputs=chunk,
                old_logps=chunk_old,
                advantages=chunk_adv,
                micro_batch_size=MICRO_BATCH_SIZE,
                router_replay_action=RouterReplayAction.REPLAY_FORWARD,
            )
            model.clip_grad_and_step()
            step += 1
            logps = out.get("logps")
            out["logps"] = [logps[i : i + 1] for i in range(logps.size(0))]
            metrics.accumulate(chunk, out, old_logps=chunk_old, advantages=chunk_adv)
            log = metrics.calculate()
            log.update(model.calculate_metric(is_training=True))
            logger.info(f"[Step {step}/{MAX_STEPS}] {log}")
            if step >= MAX_STEPS:
                break
            if step % SAVE_STEPS == 0:
                model.save(f"math-grpo-checkpoint-{step}")

    logger.info(f"Training completed. optim_steps={step}")
    model.save("grpo-gsm8k-checkpoint")


if __name__ == "__main__":
    main()
