"""twinkle.sampler: generate from the base model or any served LoRA adapter, with log-probs.

`TorchSampler` (pure torch, any device) and `VLLMSampler` (`twinkle-sampler[vllm]`) share one
contract, `Sampler.sample(inputs, sampling_params, adapter_name=None)`.
"""

from twinkle.sampler.adapters import AdapterWeights, extract_adapter, load_adapter_folder, save_adapter_folder
from twinkle.sampler.base import Sampler
from twinkle.sampler.params import SampledSequence, SampleResponse, SamplingParams
from twinkle.sampler.registry import get_sampler_class, register_sampler
from twinkle.sampler.torch_sampler import TorchSampler

__all__ = [
    "AdapterWeights",
    "SampleResponse",
    "SampledSequence",
    "Sampler",
    "SamplingParams",
    "TorchSampler",
    "VLLMSampler",
    "extract_adapter",
    "get_sampler_class",
    "load_adapter_folder",
    "register_sampler",
    "save_adapter_folder",
]


def __getattr__(name: str):
    # vllm is an optional extra: importing twinkle.sampler must not need it.
    if name == "VLLMSampler":
        from twinkle.sampler.vllm_sampler import VLLMSampler

        return VLLMSampler
    if name == "vLLMSampler":  # twinkle-kit's name and signature (engine_args=, device_mesh=, adapter_path=)
        from twinkle.sampler.kit_vllm import vLLMSampler

        return vLLMSampler
    raise AttributeError(f"module 'twinkle.sampler' has no attribute {name!r}")
