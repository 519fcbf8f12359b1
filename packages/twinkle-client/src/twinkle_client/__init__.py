"""twinkle-kit's client import path (`twinkle_client`), on our client (`twinkle.client`).

Scripts written for modelscope's twinkle-kit import from here; every class is ours behind their names:

    from twinkle_client import init_twinkle_client            # -> twinkle_client.TwinkleClient (ours, plus runs
    from twinkle_client.model import MultiLoraTransformersModel  #    / checkpoints / capabilities listings)
    from twinkle_client.sampler import vLLMSampler
    from twinkle_client.dataset import Dataset                 # built on this machine (twinkle-client[local-encoding])
    from twinkle_client.dataloader import DataLoader

Calls are synchronous here, as twinkle-kit's are (each waits for its result); `twinkle.client` keeps the
pipelined, Future-returning proxies. No torch is imported unless a dataset is built on this machine.
"""

from twinkle_client.manager import TwinkleClient, init_tinker_client, init_twinkle_client

__all__ = ["TwinkleClient", "init_tinker_client", "init_twinkle_client"]
