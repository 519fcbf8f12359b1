# Data components only, in the shape of twinkle-kit's Quick-Start "Using Only Partial Components"
# (written for this suite): a PackingDataset bin-packs the encoded rows and a DataLoader batches them.
from twinkle.dataloader import DataLoader
from twinkle.dataset import DatasetMeta, PackingDataset
from twinkle.preprocessor import SelfCognitionProcessor


def train():
    dataset = PackingDataset(DatasetMeta(dataset_id="ms://swift/self-cognition"))
    dataset.map(SelfCognitionProcessor(model_name="Twinkle Model", model_author="ModelScope Community"))
    dataset.set_template("Qwen3_5Template", model_id="ms://Qwen/Qwen3.5-4B", max_length=512)
    dataset.encode()
    dataset.pack_dataset()
    loader = DataLoader(dataset, batch_size=8)
    for data in loader:
        print({key: len(value) for key, value in data[0].items()})
        break


if __name__ == "__main__":
    train()
