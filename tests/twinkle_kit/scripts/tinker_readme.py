# twinkle-kit's README "Access the Serverless Training Services via Tinker-compatible API", in its shape
# (written for this suite): twinkle's dataset and dataloader feed the unmodified Tinker SDK.
from tqdm import tqdm
from tinker import types

from twinkle import init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.common import input_feature_to_datum

base_model = "ms://Qwen/Qwen3.8-27B"
base_url = "your-base-url"
api_key = "your-api-key"

dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(500)))
dataset.set_template("Qwen3_5Template", model_id=base_model, max_length=256)
dataset.map(SelfCognitionProcessor("twinkle Model", "ModelScope Team"), load_from_cache_file=False)
dataset.encode(batched=True, load_from_cache_file=False)
dataloader = DataLoader(dataset=dataset, batch_size=8)

init_tinker_client()
from tinker import ServiceClient  # noqa: E402

service_client = ServiceClient(base_url=base_url, api_key=api_key)
training_client = service_client.create_lora_training_client(base_model=base_model[len("ms://") :], rank=16)
for epoch in range(3):
    for step, batch in tqdm(enumerate(dataloader)):
        input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]
        fwdbwd_future = training_client.forward_backward(input_datum, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        fwdbwd_result = fwdbwd_future.result()
        optim_result = optim_future.result()
    training_client.save_state(f"twinkle-lora-{epoch}").result()
