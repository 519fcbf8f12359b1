"""IGNORE_INDEX: the label of a position that carries no loss (a prompt token, padding).

-100 is what transformers' models and `torch.nn.functional.cross_entropy` ignore by default, so rows
labelled here train unchanged in either. Every member of the library reads it from here; the client
(no library dependency) keeps the same value in its wire schema (`twinkle.client.schema`).
"""

IGNORE_INDEX = -100
