"""The range of every numeric field a client may send, in one place: the native schema's pydantic
fields, the Tinker routes' hand-read JSON and the OpenAI bodies all check against these.

A value outside its range, or not finite, is refused before anything is allocated or queued, with a
message naming the field, the value and the range (`OutOfRange`). Ranges that depend on the server
(a LoRA rank bounded by the base model's width and by `caps.max_lora_rank`, max_tokens by the
model's context) take their upper end from the server; the static part is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field


class OutOfRange(ValueError):
    """A request field outside its range: the servers answer 400 (Tinker, OpenAI) or 422 (native)."""

    def __init__(self, field: str, value, expected: str):
        shown = repr(value) if len(repr(value)) <= 64 else f"{repr(value)[:30]}...({len(repr(value))} characters)"
        super().__init__(f"{field} = {shown} is outside its range: {expected}")
        self.field, self.value, self.expected = field, value, expected


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # True: lo itself is refused
    hi_open: bool = False
    integer: bool = False

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{kind} in {'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"

    def contains(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.integer and not isinstance(v, int):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def check(self, field: str, v, default=None):
        """`v` if inside the range (None -> `default`), else OutOfRange naming `field`."""
        if v is None and default is not None:
            return default
        if not self.contains(v):
            raise OutOfRange(field, v, str(self))
        return v if self.integer else float(v)

    def below(self, hi: float) -> Range:
        """This range with its upper end lowered to `hi` (a server cap or a model dimension)."""
        return Range(self.lo, hi if self.hi is None else min(self.hi, hi), self.lo_open, False, self.integer)

    def field(self, default=..., **kw):
        """A pydantic Field enforcing this range (finite floats only), for the typed schemas."""
        bounds: dict[str, Any] = {("gt" if self.lo_open else "ge"): self.lo} if self.lo is not None else {}
        if self.hi is not None:
            bounds["lt" if self.hi_open else "le"] = self.hi
        if not self.integer:
            bounds["allow_inf_nan"] = False
        return Field(default, **bounds, **kw)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) >= 1e6 else f"{x:g}"


# ---- optimizer (Tinker AdamParams, native set_optimizer kwargs, clip_grad_and_step) ----------------
# 0 is where a decayed schedule ends (cosine, linear to zero): a step that moves nothing, not an error.
# Past 1e3 every step diverges: a typo, not a schedule.
LEARNING_RATE = Range(lo=0, hi=1e3)
BETA = Range(lo=0, hi=1, hi_open=True)
EPS = Range(lo=0, lo_open=True, hi=1.0)
WEIGHT_DECAY = Range(lo=0, hi=1e3)
GRAD_CLIP = Range(lo=0, lo_open=True)  # None: no clipping (Tinker's grad_clip_norm 0.0 also means none)
TINKER_GRAD_CLIP = Range(lo=0)
# ---- LoRA -------------------------------------------------------------------------------------------
LORA_RANK = Range(lo=1, integer=True)  # upper end: the server's (model width, caps.max_lora_rank)
LORA_ALPHA = Range(lo=0, lo_open=True, hi=1e6)
LORA_DROPOUT = Range(lo=0, hi=1, hi_open=True)
MAX_TARGET_PATTERN = 512  # characters of a regex target_modules (each matched against every module name)
# ---- sampling ---------------------------------------------------------------------------------------
TEMPERATURE = Range(lo=0, hi=1e4)  # 0 is greedy; past 1e4 the softmax is uniform to fp32 anyway
TOP_P = Range(lo=0, lo_open=True, hi=1)
TOP_K = Range(lo=-1, hi=2**31 - 1, integer=True)  # -1 (and native 0): no top-k
MAX_TOKENS = Range(lo=1, hi=2**31 - 1, integer=True)  # and within the model's context (server)
NUM_SAMPLES = Range(lo=1, hi=1024, integer=True)
MAX_STOP = 64  # stop sequences per request
MAX_STOP_CHARS = 1024  # characters of one stop string (every decoded step is matched against each)
# ---- integers the server stores or seeds with -------------------------------------------------------
SEED = Range(lo=-(2**63), hi=2**64 - 1, integer=True)  # exactly what torch.manual_seed accepts
SEQ_ID = Range(lo=0, hi=2**63 - 1, integer=True)  # SQLite's signed 64-bit integers
TTL_SECONDS = Range(lo=1, hi=100 * 365 * 86400, integer=True)  # a century: far inside the calendar
GRAD_ACCUMULATION = Range(lo=1, hi=1 << 20, integer=True)
METRIC = Range()  # any finite number

# pydantic types for the schemas
Seed = Annotated[int, SEED.field()]
FiniteFloat = Annotated[float, METRIC.field()]
