"""One SFT loop, four ways to run it. Only the set-up block below differs between modes.

    uv run examples/sft_any_mode.py                                   # local: one process
    uv run torchrun --nproc_per_node=2 examples/sft_any_mode.py       # torchrun: DDP over 2 ranks
    TWINKLE_MODE=ray uv run examples/sft_any_mode.py                  # ray: a group of 2 actors
    TWINKLE_MODE=http TWINKLE_BASE_URL=http://127.0.0.1:8000 TWINKLE_API_KEY=tml-... uv run examples/sft_any_mode.py

With the same global batch the loss curves agree: local, torchrun and ray to ~1e-6 (DDP's gradient
all-reduce vs one process), http exactly as local (the server's adapter starts from the weights peft
draws after the same seed). Set TWINKLE_CURVE_OUT=path.json to write the curve (torchrun: one file
per rank, `path.rank1.json` for rank 1).
"""

import json
import logging
import os

from peft import LoraConfig

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import DEFAULT_MODEL
from twinkle.mesh import DeviceGroup, DeviceMesh, initialize  # = twinkle.initialize, without the meta package
from twinkle.preprocessor import Filter, SelfCognitionProcessor

MODE = os.environ.get("TWINKLE_MODE", "local")
BASE = os.environ.get("TWINKLE_SFT_MODEL", DEFAULT_MODEL)
STEPS = int(os.environ.get("TWINKLE_SFT_STEPS", "0")) or None
LR = float(os.environ.get("TWINKLE_SFT_LR", "1e-4"))


# ---- the set-up: the only part that differs between modes ----------------------------------------
def value(answer):
    """What a call answered: the value itself here, or (http) what its Future holds once it is done."""
    return answer


if MODE == "http":
    from twinkle.client import init_twinkle_client
    from twinkle.client.model import TransformersModel

    init_twinkle_client(base_url=os.environ["TWINKLE_BASE_URL"], api_key=os.environ["TWINKLE_API_KEY"])

    def value(answer):
        return answer.result()

elif MODE == "ray":
    from twinkle.model import TransformersModel

    initialize(mode="ray", groups=[DeviceGroup(name="default", ranks=2, device_type="cpu")])
else:  # local: one process, or one rank of a torchrun job
    from twinkle.model import TransformersModel

    initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes(dp_size=int(os.environ.get("WORLD_SIZE", "1"))))
# ----------------------------------------------------------------------------------------------------


class LossTokens(Filter):
    """Rows with exactly `n` loss tokens. DDP averages each rank's token-mean loss, which equals the
    global batch's token mean only when every rank holds as many loss tokens; rows of one size make
    the torchrun/ray curves comparable to one process. (A real job would not need this.)"""

    def __init__(self, n: int):
        self.n = n

    def keep(self, row):
        return sum(1 for t in row["labels"] if t != -100) == self.n


def train():
    dataset = Dataset(dataset_meta=DatasetMeta("twinkle://self-cognition", data_slice=range(200)))
    dataset.set_template("Template", model_id=BASE, max_length=64)
    dataset.map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))
    dataset.encode()
    dataset.filter(LossTokens(13))

    dataloader = DataLoader(dataset=dataset, batch_size=8, min_batch_size=8, seed=0)
    model = TransformersModel(model_id=BASE, remote_group="default")

    model.add_adapter_to_model(
        "default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"), gradient_accumulation_steps=2
    )
    model.set_optimizer(optimizer_cls="AdamW", lr=LR)
    model.set_lr_scheduler(
        scheduler_cls="CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=STEPS or len(dataloader)
    )

    losses = []
    for step, batch in enumerate(dataloader):
        if STEPS is not None and step >= STEPS:
            break
        losses.append(model.forward_backward(inputs=batch))  # a dict, or (http) a future of one
        model.clip_grad_and_step()  # steps only on accumulation boundaries
        if step % 4 == 0:
            print(step, value(model.calculate_metric(is_training=True)))
    losses = [float(out["loss"]) for out in losses]
    path = value(model.save(os.environ.get("TWINKLE_SFT_OUTPUT", "last-checkpoint")))
    print("saved", path)
    out = os.environ.get("TWINKLE_CURVE_OUT")
    rank = int(os.environ.get("RANK", "0"))
    if out:
        target = out if rank == 0 else out.replace(".json", f".rank{rank}.json")
        with open(target, "w") as f:
            json.dump({"mode": MODE, "losses": losses, "checkpoint": str(path)}, f)
    return losses


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("TWINKLE_LOG_LEVEL", "WARNING"))
    train()
