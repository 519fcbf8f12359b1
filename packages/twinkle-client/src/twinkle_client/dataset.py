"""twinkle-kit's client datasets: ours (twinkle.dataset), built on this machine.

twinkle-kit builds a client's dataset on the server; ours reads the data where the script runs (the
data file a script names is on the user's machine, and a server never opens paths a client names), so
these are twinkle-data's classes themselves: `pip install 'twinkle-client[local-encoding]'`.
"""

from __future__ import annotations

try:
    from twinkle.dataset import (
        Dataset,
        DatasetMeta,
        IterableDataset,
        IterablePackingDataset,
        LazyDataset,
        PackingDataset,
    )
except ImportError as e:  # the client alone: say what to install
    raise ImportError(
        "twinkle_client.dataset builds datasets here: pip install 'twinkle-client[local-encoding]'"
    ) from e

__all__ = ["Dataset", "DatasetMeta", "IterableDataset", "IterablePackingDataset", "LazyDataset", "PackingDataset"]
