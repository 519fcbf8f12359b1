"""Whether a script's saved adapter learned: its loss on the data the script trained on, against the
base model's (the same model with the adapter switched off)."""

from __future__ import annotations

from pathlib import Path

from twinkle.hub import TEST_MODEL


class AdapterJudge:
    """One base model; each adapter folder is loaded beside the others under its own name."""

    def __init__(self, model_id: str = TEST_MODEL):
        from twinkle.model import TransformersModel

        self.model = TransformersModel(model_id=model_id)
        self.model_id = model_id
        self.count = 0

    def rows(self, names: tuple[str, str], n: int = 16) -> list[dict]:
        from twinkle.dataset import Dataset, DatasetMeta
        from twinkle.preprocessor import SelfCognitionProcessor

        ds = Dataset(DatasetMeta("twinkle://self-cognition", data_slice=range(n))).map(SelfCognitionProcessor(*names))
        return list(ds.set_template("Qwen3_5Template", model_id=self.model_id, max_length=256).encode(cache=False))

    def losses(self, folder: Path, rows: list[dict]) -> tuple[float, float]:
        """(the adapter's loss, the base model's loss) on `rows`."""
        self.count += 1
        name = f"judged{self.count}"
        self.model.load(str(folder), adapter_name=name)
        tuned = self.model.forward_only(inputs=rows, adapter_name=name)["loss"]
        base = self.model.forward_only(inputs=rows, adapter_name=name, disable_lora=True)["loss"]
        return tuned, base


def checkpoint_path(url: str, key: str, name: str) -> str:
    """The tinker:// path of this tenant's newest checkpoint called `name`."""
    from twinkle.client import TwinkleClient
    from twinkle.client.schema import CheckpointList

    client = TwinkleClient(url, key)
    found = [c for c in CheckpointList.model_validate(client.get("/checkpoints")).checkpoints if c.name == name]
    if not found:
        raise AssertionError(f"the server has no checkpoint named {name!r} (the script that saves it runs first)")
    return max(found, key=lambda c: c.created_at).path


def server_checkpoint(url: str, key: str, name: str, into: Path) -> Path:
    """Download the newest checkpoint called `name` of this tenant into `into`."""
    from twinkle.client import TwinkleClient
    from twinkle.client.download import download_checkpoint

    download_checkpoint(TwinkleClient(url, key), checkpoint_path(url, key, name), into)
    return into
