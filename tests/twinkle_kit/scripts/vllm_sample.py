"""Sampling with a LoRA adapter from a folder, through a vLLM sampler in a Ray group, in the shape of
twinkle-kit's cookbook sample/sample.py (written for this suite): settings through twinkle.cli
(`--model-id`, `--lora-path`, `--sampler-gpus`), one sampler group, chats as prompts, the adapter named
by its path at sample time, completions decoded with the sampler's template.
"""

import twinkle
from twinkle import DeviceGroup, DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.sampler import vLLMSampler

logger = get_logger()
args = CLI.from_args()

SAMPLER_GPUS = args.infra.sampler_gpus or 1
LORA_PATH = args.lora.lora_path or "/path/to/lora"

CHATS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime number."}],
    [{"role": "user", "content": "Describe the sea in five words."}],
]


def main():
    groups = [
        DeviceGroup(name="sampler", ranks=list(range(SAMPLER_GPUS)), device_type="GPU", gpus_per_worker=SAMPLER_GPUS)
    ]
    mesh = DeviceMesh.from_sizes(world_size=SAMPLER_GPUS, tp_size=SAMPLER_GPUS)
    twinkle.initialize(mode="ray", nproc_per_node=SAMPLER_GPUS, groups=groups)

    sampler = vLLMSampler(
        model_id=args.model.model_id,
        engine_args={
            "gpu_memory_utilization": 0.7,
            "max_model_len": 4096,
            "enable_lora": True,
            "max_loras": 1,
            "max_lora_rank": 32,
            "enable_tower_connector_lora": True,
        },
        device_mesh=mesh,
        remote_group="sampler",
    )
    sampler.set_template("Qwen3_5Template", model_id=args.model.model_id)
    logger.info(get_device_placement())

    params = SamplingParams(max_tokens=256, temperature=0.7, top_p=0.9, num_samples=1)
    prompts = [{"messages": chat} for chat in CHATS]
    responses = sampler.sample(prompts, params, adapter_path=LORA_PATH)

    for i, response in enumerate(responses):
        for seq in response.sequences:
            text = sampler.template.tokenizer.decode(seq.tokens, skip_special_tokens=True)
            logger.info(f"prompt {i}: {CHATS[i][-1]['content']!r} -> {len(seq.tokens)} tokens: {text!r}")
    logger.info("Done.")


if __name__ == "__main__":
    main()
