"""Sampling from a saved LoRA checkpoint with the unmodified Tinker SDK against a Twinkle server, in the
shape of twinkle-kit's cookbook client/tinker/sample.py (written for this suite): a sampling client from
a checkpoint path, a chat encoded locally with the model's template, completions decoded with it."""

import os

from tinker import types

from twinkle import init_tinker_client
from twinkle.data_format import Message, Trajectory
from twinkle.template import Qwen3_5Template

init_tinker_client()

from tinker import ServiceClient  # noqa: E402

base_model = os.environ.get("TWINKLE_MODEL_ID", "Qwen/Qwen3.5-4B")
service_client = ServiceClient(
    base_url=os.environ.get("TWINKLE_SERVER_URL", "http://localhost:8000"),
    api_key=os.environ.get("TWINKLE_SERVER_TOKEN", "EMPTY_TOKEN"),
)

# a checkpoint an earlier run saved (its path as the server reported it)
sampling_client = service_client.create_sampling_client(
    model_path="twinkle://20260101_000000-Qwen_Qwen3_5-4B-0000/weights/pig-latin-lora-epoch-1",
    base_model=base_model,
)
print(f"Sampling {base_model} with a saved adapter")

template = Qwen3_5Template(model_id=f"ms://{base_model}")
trajectory = Trajectory(
    messages=[
        Message(role="system", content="Translate to Pig Latin."),
        Message(role="user", content="English: apple pie\nPig Latin:"),
    ]
)
input_feature = template.encode(trajectory, add_generation_prompt=True)
input_ids = input_feature["input_ids"].tolist()

prompt = types.ModelInput.from_ints(input_ids)
params = types.SamplingParams(max_tokens=128, temperature=0.7)
result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=2).result()

print("Responses:")
for i, seq in enumerate(result.sequences):
    print(f"{i}: {len(seq.tokens)} tokens: {template.decode(seq.tokens)!r}")
