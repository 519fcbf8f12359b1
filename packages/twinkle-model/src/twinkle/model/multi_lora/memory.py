"""Keeping a long-running multi-tenant process's memory near what it holds: base + adapters + optimizer.

Two things make a server's RSS grow past that. glibc keeps freed activation memory of every pass in
its heaps for reuse (untrimmed, 8 tenants on the demo model measured 3.76x the ideal), and a
sampler that loads its own copy of the frozen base holds those bytes twice.
- `IdleTrimmer` hands freed heap memory back (`malloc_trim`) once the engine has been idle for a
  moment: never between the passes of a busy stretch, where the next pass would only fault the
  same pages back in, but always before an operator looks at an idle server.
- `share_frozen_weights` points a second model's parameters at the first one's tensors.
"""

from __future__ import annotations

import ctypes
import threading
import time

from torch import nn

_M_ARENA_MAX = -8  # mallopt parameter numbers from glibc's malloc.h


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): its allocator returns memory its own way
        return None


def release_free_memory() -> bool:
    """Return freed heap memory of every malloc arena to the OS; False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's per-thread arenas (as MALLOC_ARENA_MAX does): a server's request threads each get
    an arena otherwise, and memory freed in one is never reused by another."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_ARENA_MAX, arenas)


class IdleTrimmer:
    """Calls `release_free_memory()` once `idle_seconds` after the last `touch()` (a daemon thread)."""

    def __init__(self, idle_seconds: float = 1.0):
        if idle_seconds <= 0:
            raise ValueError(f"idle_seconds must be positive, got {idle_seconds!r}")
        self.idle_seconds = idle_seconds
        self.trims = 0
        self._last = time.monotonic()
        self._work = threading.Event()
        threading.Thread(target=self._loop, name="twinkle-idle-trim", daemon=True).start()

    def touch(self) -> None:
        self._last = time.monotonic()
        self._work.set()

    def _loop(self) -> None:
        while True:
            self._work.wait()
            quiet = time.monotonic() - self._last
            if quiet < self.idle_seconds:
                time.sleep(self.idle_seconds - quiet)
                continue
            self._work.clear()
            release_free_memory()
            self.trims += 1


def share_frozen_weights(source: nn.Module, target: nn.Module) -> int:
    """Make `target`'s parameters use `source`'s tensors wherever names, shapes and dtypes agree
    (MultiLoraLinear's `.base_layer` is ignored in names); returns the bytes no longer held twice.
    Only for frozen weights: both models then see every write to either."""

    def plain(name: str) -> str:
        return name.replace(".base_layer.", ".")

    own = {plain(n): p for n, p in source.named_parameters() if ".lora_" not in n}
    shared = 0
    for name, param in target.named_parameters():
        src = own.get(plain(name))
        if src is None or src.shape != param.shape or src.dtype != param.dtype or src.device != param.device:
            continue
        if src.data_ptr() != param.data_ptr():
            param.data = src.data
            shared += param.numel() * param.element_size()
    return shared
