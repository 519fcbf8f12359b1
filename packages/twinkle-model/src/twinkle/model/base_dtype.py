"""Which dtype the frozen base is stored and multiplied in: `base_dtype='auto' | 'bf16' | 'fp32'`.

LoRA trains only its factors, so the base's weights are read, never updated: held in bf16 they take
half the bytes and, where the hardware multiplies bf16 fast (every GPU; CPUs with AVX-512 BF16 or AMX
tiles, ~6x the fp32 matmul peak on an AMX core), multiply faster too. The LoRA factors and their
optimizer state stay fp32 (peft's `autocast_adapter_dtype`, and `MultiLoraLinear` alike), and the
LoRA product is added to the base's output in fp32 before the single rounding to bf16.

`auto` picks bf16 when
- `mixed_precision='bf16'` was asked for (the matmuls run in bf16 anyway; an fp32 base under
  autocast only costs its bytes and a cast per matmul), or
- the hardware multiplies bf16 fast and the base has at least `AUTO_BF16_MIN_PARAMS` parameters: below
  that a step is Python and small-matmul overhead, bf16 saves little memory and costs precision (the
  embedded test models, 0.25M-51M parameters, stay fp32 on every machine, so tests compare the same
  numbers everywhere);
and fp32 otherwise. A model whose every weight trains (no adapter) keeps fp32 master weights under
`auto` (TransformersModel upcasts it when the whole model starts training).
"""

from __future__ import annotations

import functools

import torch

BASE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
AUTO_BF16_MIN_PARAMS = 100_000_000


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_bf16(device: torch.device | str) -> bool:
    """Whether bf16 matmuls are fast here: any CUDA device; a CPU with AVX-512 BF16 or AMX that torch
    uses (a forced `ATEN_CPU_CAPABILITY=avx2` runs bf16 through slow conversions, so it does not count)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX", "AVX512_BF16"):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def check(base_dtype: str) -> None:
    if base_dtype != "auto" and base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be 'auto', 'bf16' or 'fp32', got {base_dtype!r}")


def resolve(base_dtype: str, mixed_precision: str | None, device: torch.device | str, n_params: int) -> torch.dtype:
    """The dtype the frozen base is held in (module docstring)."""
    check(base_dtype)
    if base_dtype != "auto":
        return BASE_DTYPES[base_dtype]
    if mixed_precision == "bf16":
        return torch.bfloat16
    fp32_compute = mixed_precision is None or mixed_precision in ("no", "fp32")
    if fp32_compute and n_params >= AUTO_BF16_MIN_PARAMS and fast_bf16(device):
        return torch.bfloat16
    return torch.float32


def name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter in `dtype`, in place (the Parameter objects stay). Buffers keep
    theirs: rotary inverse frequencies in bf16 would shift every position's angle."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
