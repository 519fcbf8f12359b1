"""twinkle.dataset: datasets from bundled ids, hub ids, local files or in-memory rows."""

from twinkle.dataset.arrow_encode import EncodeReport, encode_to_arrow
from twinkle.dataset.dataset import ERROR_KEY, Dataset
from twinkle.dataset.errors import DataError, SequenceTooLongError
from twinkle.dataset.lazy import LazyDataset
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.packing import IterableDataset, IterablePackingDataset, PackingDataset, pack_rows
from twinkle.dataset.sources import BUNDLED, resolve_dataset_path
from twinkle.dataset.stream import RowStream
from twinkle.hub import OfflineError
from twinkle.registry import Registry

__all__ = [
    "BUNDLED",
    "ERROR_KEY",
    "DataError",
    "Dataset",
    "DatasetMeta",
    "EncodeReport",
    "IterableDataset",
    "IterablePackingDataset",
    "LazyDataset",
    "OfflineError",
    "PackingDataset",
    "Registry",
    "RowStream",
    "SequenceTooLongError",
    "encode_to_arrow",
    "pack_rows",
    "resolve_dataset_path",
]
