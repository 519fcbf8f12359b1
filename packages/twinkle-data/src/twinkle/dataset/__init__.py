"""twinkle.dataset: datasets from bundled ids, hub ids, local files or in-memory rows."""

from twinkle.dataset.arrow_encode import EncodeReport, encode_to_arrow
from twinkle.dataset.dataset import ERROR_KEY, Dataset
from twinkle.dataset.errors import DataError, SequenceTooLongError
from twinkle.dataset.meta import DatasetMeta
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
    "OfflineError",
    "Registry",
    "RowStream",
    "SequenceTooLongError",
    "encode_to_arrow",
    "resolve_dataset_path",
]
