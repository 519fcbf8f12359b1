"""`TransformersModel(compile=True)`: torch.compile (inductor) over each decoder layer.

The decoder layer is the block a transformer repeats, so it is what gets compiled, one layer at a
time as torchtitan does: every layer of a family shares the compiled code (torch inlines the layer's
own modules and passes their weights in as inputs), the model's mask building, embeddings, head and
loss stay eager, and a peft adapter added later is simply traced at the first pass that meets it.
What it buys on CPU is fused elementwise work (norms, rotary, activations, casts), which at the
sizes these machines train is most of a step: the demo model's 8x128 LoRA step ran 1.36x faster in
fp32 and 1.6x in bf16 on an AMX CPU. What it costs is the first passes: 15-40 s on 2 cores with a
cold inductor cache (a new sequence length compiles once more, then lengths are dynamic), so it is
for runs long enough to earn that back, and off by default.

Under a forced `ATEN_CPU_CAPABILITY` inductor's on-disk cache moves to a directory of its own
(`separate_inductor_cache`). Refused by name: context parallelism (its attention swaps in collectives
that inductor would have to trace) and tensor parallelism (DTensor layers under compile are not
tested here); on CPU, a machine without a C++ compiler, which inductor needs to build its kernels.
"""

from __future__ import annotations

import os
import shutil

from torch import nn
from torch._dynamo import config as dynamo_config

from twinkle.model.structure import decoder_layer_list

# Every decoder layer runs the same Python code (transformers' layer __call__), and dynamo keeps a
# limited number of compiled variants per code object, 8 by default, before it silently runs that code
# eagerly. One adapter's training already takes four (the first layer's input needs no grad, the
# others' does; the first length static, later ones dynamic), forward_only two more, and each further
# adapter (peft guards on the active one) its own: a process that serves a few would fall back to eager.
RECOMPILE_LIMIT = 64


def language_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the language model (a vision-language model's text decoder)."""
    layers = decoder_layer_list(model)
    if not layers:
        raise TypeError(
            f"compile=True compiles the decoder's layers, and {type(model).__name__} has no "
            "get_decoder().layers list: leave compile off for this architecture"
        )
    return layers


def check_compilable(device_type: str, cp_size: int, tp_size: int) -> None:
    if cp_size > 1 or tp_size > 1:
        what = f"context parallelism (cp_size={cp_size})" if cp_size > 1 else f"tensor parallelism (tp_size={tp_size})"
        raise ValueError(f"compile=True is not supported with {what}: leave compile off on this mesh")
    if device_type == "cpu" and not _cpp_compiler():
        raise ValueError(
            "compile=True on CPU needs a C++ compiler for torch inductor's kernels (g++, c++ or clang++ "
            "on PATH, or $CXX); none was found: install one (e.g. apt install g++) or leave compile off"
        )


def _cpp_compiler() -> str | None:
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    return next((found for name in candidates if name and (found := shutil.which(name))), None)


def separate_inductor_cache() -> None:
    """inductor's on-disk cache is not keyed on ATEN_CPU_CAPABILITY, so kernels built for one ISA get
    loaded under another (torch 2.15, measured: AVX-512 kernels run under `avx2` gave NaN losses, the
    reverse aborted the process). A forced capability gets a cache directory of its own."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    default = os.path.abspath(default_cache_dir())
    # torch writes its default into the environment the first time anything asks for the cache (loading
    # a model does): that is still no directory a user chose
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{capability}"


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer in place (names and state dicts unchanged); returns how many."""
    layers = language_layers(model)
    separate_inductor_cache()
    limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.recompile_limit = limit  # ty: ignore[invalid-assignment] - typed as its default, 8
    for layer in layers:
        layer.compile()
    return len(layers)
