"""What one run of an uploaded custom loss may compute, checked node by node before each op runs.

A custom loss (tinker/custom_loss.py) runs on the worker, inside a pass other tenants share. Its node
count is bounded when it is uploaded; this module bounds the values its nodes make, relative to the
datum it runs on (its log-probs and inputs, `n` elements in all), so a loss costs what its datum does:

- a Python int holds at most MAX_INT_BITS bits: `**` and `*` of ints are refused when their operands'
  bit lengths say the result would not fit, before Python computes it;
- a list, tuple or string holds at most MAX_ITEMS items (nested ones counted): repetition and
  concatenation are checked from their operands' lengths; `%` string formatting is refused;
- one value holds at most `ELEMENTS_PER_DATUM * n + ELEMENTS_FLOOR` tensor elements: an op whose result
  can outgrow its arguments (broadcasting between different shapes, indexing with tensors or lists,
  matrix products) runs first on the meta device, which computes the result's shape and no data;
- the run's work (elements read and written, and each matrix product's multiply-adds) is at most
  `WORK_PER_DATUM * n + WORK_FLOOR`, which bounds its time and the memory its values hold.

A refusal is an `OverBound` naming the op and the bound; the interpreter reports it as the client's error.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

MAX_INT_BITS = 4096
MAX_ITEMS = 1 << 16
ELEMENTS_PER_DATUM, ELEMENTS_FLOOR = 64, 1 << 16
WORK_PER_DATUM, WORK_FLOOR = 1024, 1 << 22
MATMULS = frozenset({torch.matmul, torch.dot, torch.outer, operator.matmul, torch.Tensor.matmul, torch.Tensor.dot})
_SEQUENCES = (list, tuple, str)


class OverBound(ValueError):
    """An op would make a value (or the run) larger than this module's bounds allow."""


def op_name(fn) -> str:
    return f"{getattr(fn, '__module__', None) or 'torch.Tensor'}.{getattr(fn, '__name__', fn)}"


def measure(value, cap: int) -> tuple[int, int, list[torch.Tensor]]:
    """(items of the lists, tuples, strings and dicts in `value`, nested; tensor elements; the tensors),
    counting each reference (a list repeated by reference is as large as its copies); stops past `cap`."""
    items, elements, tensors, stack = 0, 0, [], [value]
    while stack and items <= cap and elements <= cap:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            elements += v.numel()
            tensors.append(v)
        elif isinstance(v, str):
            items += len(v)
        elif isinstance(v, (list, tuple, dict)):
            items += len(v)
            stack.extend(v.values() if isinstance(v, dict) else v)
        elif isinstance(v, slice):
            stack.extend((v.start, v.stop, v.step))
    return items, elements, tensors


def check_int(value, what: str) -> None:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise OverBound(f"{what} is an integer of {value.bit_length()} bits; at most {MAX_INT_BITS}")


def _show(n: int) -> str:
    return str(n) if n.bit_length() <= 64 else f"a {n.bit_length()}-bit integer"


def _count(value) -> int | None:
    """`value` as a repetition count (an int, or an integer tensor of one element), else None."""
    if isinstance(value, _SEQUENCES):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_python(fn, args: tuple) -> None:
    """The int and sequence ops whose result size follows from their operands: checked before they run."""
    if len(args) != 2:
        return
    a, b = args
    ints = isinstance(a, int) and isinstance(b, int)
    if fn is operator.pow and ints and b > 0 and abs(a) > 1:
        bits = b * math.log2(abs(a))
        if bits > MAX_INT_BITS:
            raise OverBound(
                f"operator.pow({_show(a)}, {_show(b)}) would be an integer of ~{bits:.3g} bits; at most {MAX_INT_BITS}"
            )
    elif fn is operator.mul and ints:
        if a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
            raise OverBound(
                f"operator.mul of {a.bit_length()}- and {b.bit_length()}-bit integers; at most {MAX_INT_BITS} bits"
            )
    elif fn is operator.mul and (isinstance(a, _SEQUENCES) or isinstance(b, _SEQUENCES)):
        seq, times = (a, _count(b)) if isinstance(a, _SEQUENCES) else (b, _count(a))
        if times is not None and times > 0 and measure(seq, MAX_ITEMS)[0] * times > MAX_ITEMS:
            raise OverBound(
                f"operator.mul repeats a {type(seq).__name__} of {len(seq)} items {times} times; "
                f"at most {MAX_ITEMS} items"
            )
    elif fn is operator.add and isinstance(a, _SEQUENCES) and isinstance(b, _SEQUENCES):
        if measure(a, MAX_ITEMS)[0] + measure(b, MAX_ITEMS)[0] > MAX_ITEMS:
            raise OverBound(f"operator.add joins {len(a)} and {len(b)} items; at most {MAX_ITEMS}")
    elif fn is operator.mod and isinstance(a, str):
        raise OverBound("operator.mod on a string formats text, which a custom loss may not do")


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, list):
        return [_meta(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


def _basic(index) -> bool:
    """Indexing with ints, slices, None and Ellipsis only: a view, never larger than the tensor."""
    parts = index if isinstance(index, tuple) else (index,)
    return not any(isinstance(p, (list, torch.Tensor)) for p in parts)


def _mask_only(index) -> bool:
    """Indexing with boolean masks and basic indices only: the result is no larger than the tensor."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(
        not isinstance(p, (list, torch.Tensor)) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool)
        for p in parts
    )


@dataclass
class Budget:
    """The bounds of one program run on one datum (`for_datum`); `before` and `after` each node."""

    per_value: int
    work_left: int
    datum_elements: int

    @classmethod
    def for_datum(cls, tensors) -> Budget:
        n = sum(t.numel() for t in tensors)
        return cls(ELEMENTS_PER_DATUM * n + ELEMENTS_FLOOR, WORK_PER_DATUM * n + WORK_FLOOR, n)

    def _value_bound(self) -> str:
        return f"at most {self.per_value} ({ELEMENTS_PER_DATUM} x the datum's {self.datum_elements} + {ELEMENTS_FLOOR})"

    def before(self, fn, args: tuple, kwargs: dict) -> int:
        """Refuse `fn(*args, **kwargs)` if its result or its cost would pass a bound; the elements it reads."""
        check_python(fn, args)
        reads, tensors = 0, []
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor):  # the common case, without measure's walk
                reads += arg.numel()
                tensors.append(arg)
                continue
            if not isinstance(arg, (list, tuple, dict, str, slice)):
                continue
            items, elements, found = measure(arg, max(self.per_value, MAX_ITEMS))
            if items > MAX_ITEMS:
                raise OverBound(f"{op_name(fn)} takes an argument of {items} items; at most {MAX_ITEMS}")
            if elements > self.per_value:  # a list of tensors to concatenate or stack: the result is as large
                raise OverBound(f"{op_name(fn)} takes an argument of {elements} tensor elements; {self._value_bound()}")
            reads += elements
            tensors += found
        predicted, products = self._predict(fn, args, kwargs, tensors)
        if predicted > self.per_value:
            raise OverBound(f"{op_name(fn)} would make {predicted} tensor elements; {self._value_bound()}")
        if reads + predicted + products > self.work_left:
            raise OverBound(
                f"{op_name(fn)} would pass the loss's work budget ({self.work_left} elements left of "
                f"{WORK_PER_DATUM} x the datum's {self.datum_elements} + {WORK_FLOOR})"
            )
        self.work_left -= products
        return reads

    def _predict(self, fn, args, kwargs, tensors) -> tuple[int, int]:
        """(elements of the result, multiply-adds) for ops whose result can outgrow their arguments;
        (0, 0) for the rest, whose result `after` measures."""
        big = {tuple(t.shape) for t in tensors if t.numel() > 1}
        matmul = fn in MATMULS
        indexing = fn is operator.getitem and isinstance(args[0], torch.Tensor) and not _basic(args[1])
        if not (matmul or indexing or len(big) > 1):
            return 0, 0
        try:
            out = fn(*_meta(args), **_meta(kwargs))
        except NotImplementedError:  # a boolean mask's result depends on the data: at most the tensor
            if indexing and _mask_only(args[1]):
                return 0, 0
            raise OverBound(
                f"{op_name(fn)}: the size of this result depends on the data and cannot be checked first"
            ) from None
        except Exception as e:
            raise OverBound(f"{op_name(fn)} cannot run on these arguments: {type(e).__name__}: {e}") from None
        elements = measure(out, self.per_value * 4)[1]
        if not matmul:
            return elements, 0
        first = next(a for a in args if isinstance(a, torch.Tensor))
        inner = first.shape[0] if first.ndim == 1 else first.shape[-1] if first.ndim else 1
        return elements, elements * int(inner)

    def after(self, value, reads: int, what: str) -> None:
        """Refuse a result past a bound (an int's bits, a sequence's items, a value's elements); charge the work."""
        check_int(value, what)
        items, elements, _ = measure(value, max(self.per_value, MAX_ITEMS))
        if items > MAX_ITEMS:
            raise OverBound(f"{what} holds {items} items; at most {MAX_ITEMS}")
        if elements > self.per_value:
            raise OverBound(f"{what} holds {elements} tensor elements; {self._value_bound()}")
        self.work_left -= reads + elements
        if self.work_left < 0:
            raise OverBound(
                f"{what} passes the loss's work budget ({WORK_PER_DATUM} x the datum's {self.datum_elements} "
                f"+ {WORK_FLOOR} elements read and written)"
            )
