"""Custom losses uploaded by the Tinker SDK (`ServiceClient.create_custom_loss`), interpreted on the server.

The SDK traces a per-datum loss `fn(logprobs, *inputs) -> (loss, metrics)` with torch.fx and uploads
the graph as plain data (`tinker.types.CustomLossGraph`): nodes in execution order, each a placeholder,
a function named by its qualified name (`torch.exp`, `operator.mul`), a Tensor method name, or the
output. Here every name is looked up in this module's own tables of pure tensor math: nothing is
unpickled, imported or evaluated, and a name not in a table is refused with `LossGraphError` naming it.

What the nodes compute is bounded while they run (tinker/loss_bounds.py): ints in bits, lists and
strings in items, each value's tensor elements and the run's total work by a multiple of the datum's
own tensors, each checked before the op that would pass it. Tensor factories with caller-chosen sizes
(`torch.zeros(n)`, `expand`, `repeat`, `one_hot`) are left out of the tables altogether.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from twinkle.serve.tinker import loss_bounds
from twinkle.serve.tinker.loss_bounds import OverBound
from twinkle.serve.tinker.loss_ops import ATTRIBUTES, DTYPES, FUNCTIONS, LAYOUTS, MEMORY_FORMATS, METHODS

MAX_NODES = 4096
MAX_INPUTS = 16  # logprobs included, as the SDK allows
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")


class LossGraphError(ValueError):
    """The uploaded loss is malformed or uses something outside the allow-list (the client's error)."""


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Node:
    op: str  # call_function | call_method
    name: str
    call: Any  # the callable (call_function) or method name (call_method)
    args: tuple
    kwargs: dict


def _decode(arg, known: set[str], where: str):
    """One encoded argument (tinker.types.CustomLossNode.args) -> a Python value with `_Ref`s for nodes."""
    if arg is None or isinstance(arg, (bool, int, float, str)):
        try:
            loss_bounds.check_int(arg, "a literal")
        except OverBound as e:
            raise LossGraphError(f"{where}: {e}") from None
        return arg
    if isinstance(arg, list):
        return [_decode(a, known, where) for a in arg]
    if not isinstance(arg, dict) or len(arg) != 1:
        raise LossGraphError(f"{where}: argument {arg!r} is not an encoded value")
    ((kind, value),) = arg.items()
    if kind == "ref":
        if value not in known:
            raise LossGraphError(f"{where}: refers to {value!r}, which is not an earlier node")
        return _Ref(value)
    if kind == "tuple" and isinstance(value, list):
        return tuple(_decode(a, known, where) for a in value)
    if kind == "dict" and isinstance(value, dict):
        return {str(k): _decode(a, known, where) for k, a in value.items()}
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        return slice(*(_decode(a, known, where) for a in value))
    if kind == "ellipsis" and value is True:
        return Ellipsis
    if kind == "float" and value in ("inf", "-inf", "nan"):
        return float(value)
    tables = {"dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS}
    if kind in tables and value in tables[kind]:
        return tables[kind][value]
    if kind == "device" and isinstance(value, str):
        return _DEVICE  # the server decides where a loss runs: every device names the inputs' device
    raise LossGraphError(f"{where}: unsupported argument {{{kind!r}: {value!r}}}")


_DEVICE = object()


@dataclass(frozen=True)
class LossProgram:
    """A validated custom loss: `program(logprobs, *inputs) -> (scalar loss, {metric: scalar tensor})`."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank), logprobs first
    nodes: tuple[_Node, ...]
    loss: _Ref
    metrics: dict

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.inputs[1:])

    @classmethod
    def parse(cls, name, inputs, graph) -> LossProgram:
        if not isinstance(name, str) or not name:
            raise LossGraphError("name must be a non-empty string")
        parsed_inputs = _parse_inputs(inputs)
        nodes = graph.get("nodes") if isinstance(graph, dict) else None
        if not isinstance(graph, dict) or graph.get("format", 1) != 1 or not isinstance(nodes, list):
            raise LossGraphError('graph must be {"format": 1, "nodes": [...]}')
        if len(nodes) > MAX_NODES:
            raise LossGraphError(f"graph has {len(nodes)} nodes; at most {MAX_NODES}")
        known: set[str] = set()
        placeholders, program, output = [], [], None
        for i, node in enumerate(nodes):
            if output is not None:
                raise LossGraphError(f"node {i} follows the output node")
            op, node_name, target, where = _node_fields(i, node)
            if node_name in known:
                raise LossGraphError(f"{where}: duplicate node name")
            args = _decode(node.get("args", []), known, where)
            kwargs = _decode({"dict": node.get("kwargs", {})}, known, where)
            if op == "placeholder":
                placeholders.append(target)
            elif op == "output":
                output = args
            else:
                program.append(_call_node(op, node_name, target, args, kwargs, where))
            known.add(node_name)
        if placeholders != [n for n, _ in parsed_inputs]:
            raise LossGraphError(
                f"graph placeholders {placeholders} do not match inputs {[n for n, _ in parsed_inputs]}"
            )
        loss, metrics = _parse_output(output)
        return cls(name, parsed_inputs, tuple(program), loss, metrics)

    def __call__(self, *tensors: torch.Tensor):
        env = dict(zip((n for n, _ in self.inputs), tensors))
        device = tensors[0].device
        budget = loss_bounds.Budget.for_datum(tensors)
        for node in self.nodes:
            args = _resolve(node.args, env, device)
            kwargs = _resolve(node.kwargs, env, device)
            if node.op == "call_method" and not isinstance(args[0], torch.Tensor):
                raise LossGraphError(
                    f"node {node.name!r}: method {node.call!r} called on a {type(args[0]).__name__}, not a tensor"
                )
            fn = getattr(torch.Tensor, node.call) if node.op == "call_method" else node.call
            try:
                reads = budget.before(fn, args, kwargs)
                env[node.name] = fn(*args, **kwargs)
                budget.after(env[node.name], reads, f"the value of {loss_bounds.op_name(fn)}")
            except OverBound as e:
                raise LossGraphError(f"loss {self.name!r} refused at node {node.name!r}: {e}") from None
            except Exception as e:
                raise LossGraphError(
                    f"loss {self.name!r} failed at node {node.name!r}: {type(e).__name__}: {e}"
                ) from None
        loss = env[self.loss.name]
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossGraphError(f"loss {self.name!r} must return a scalar loss, got {shape}")
        metrics = {}
        for key, ref in self.metrics.items():
            value = env[ref.name]
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise LossGraphError(f"loss {self.name!r} metric {key!r} must be a scalar tensor")
            metrics[key] = value
        return loss, metrics


def _parse_inputs(inputs) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not inputs or len(inputs) > MAX_INPUTS:
        raise LossGraphError(f"inputs must be a list of 1 to {MAX_INPUTS} {{name, rank}} objects")
    out = []
    for i, item in enumerate(inputs):
        name, rank = (item.get("name"), item.get("rank")) if isinstance(item, dict) else (None, None)
        if (
            not isinstance(name, str)
            or not _INPUT_NAME.fullmatch(name)
            or rank not in (0, 1, 2)
            or isinstance(rank, bool)
        ):
            raise LossGraphError(f"inputs[{i}] must be {{name: lowercase identifier, rank: 0|1|2}}, got {item!r}")
        out.append((name, rank))
    if out[0] not in (("logprobs", 1), ("logprobs", 2)):
        raise LossGraphError(
            f"the first input must be logprobs with rank 1 ([T] target tokens) or 2 ([T, K]), got {out[0]}"
        )
    if len({n for n, _ in out}) != len(out):
        raise LossGraphError("input names must be distinct")
    return tuple(out)


def _node_fields(i: int, node) -> tuple[str, str, str, str]:
    if not isinstance(node, dict):
        raise LossGraphError(f"node {i} must be an object")
    op, name, target = node.get("op"), node.get("name"), node.get("target")
    if not all(isinstance(v, str) for v in (op, name, target)):
        raise LossGraphError(f"node {i} needs string op, name and target")
    if not isinstance(node.get("args", []), list) or not isinstance(node.get("kwargs", {}), dict):
        raise LossGraphError(f"node {i} ({name!r}): args must be a list and kwargs an object")
    return op, name, target, f"node {i} ({name!r})"


def _call_node(op: str, node_name: str, target: str, args: list, kwargs: dict, where: str) -> _Node:
    """A call_function or call_method node, checked; any other op is refused."""
    if op == "call_function":
        fn = _function(target, args, where)
        if not _refers(args):  # constant operands: `operator.pow(7, 10**7)` is refused on upload
            try:
                loss_bounds.check_python(fn, tuple(args))
            except OverBound as e:
                raise LossGraphError(f"{where}: {e}") from None
        return _Node(op, node_name, fn, tuple(args), kwargs)
    if op == "call_method":
        if target not in METHODS:
            raise LossGraphError(
                f"{where}: Tensor method {target!r} is not allowed in a custom loss; "
                f"allowed: {', '.join(sorted(METHODS))}"
            )
        if not args:
            raise LossGraphError(f"{where}: method call {target!r} has no tensor to call it on")
        return _Node(op, node_name, target, tuple(args), kwargs)
    # get_attr (a captured tensor), call_module (an nn.Module): never rebuilt here
    raise LossGraphError(
        f"{where}: op {op!r} (target {target!r}) is not allowed in a custom loss; "
        "only placeholder, call_function, call_method and output"
    )


def _function(target: str, args: list, where: str):
    if target == "getattr":  # fx records `x.shape` as getattr(x, "shape"): only these read-only attributes
        if len(args) != 2 or args[1] not in ATTRIBUTES:
            raise LossGraphError(
                f"{where}: getattr of {args[1:]!r} is not allowed; attributes allowed: {', '.join(sorted(ATTRIBUTES))}"
            )
        return getattr
    if target not in FUNCTIONS:
        raise LossGraphError(
            f"{where}: function {target!r} is not allowed in a custom loss (not on this "
            "server's allow-list of torch, torch.nn.functional, math and operator functions)"
        )
    return FUNCTIONS[target]


def _parse_output(output) -> tuple[_Ref, dict]:
    if output is None:
        raise LossGraphError("graph has no output node")
    value = output[0] if isinstance(output, (list, tuple)) and len(output) == 1 else None
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and isinstance(value[0], _Ref)
        and isinstance(value[1], dict)
    ):
        raise LossGraphError("the output must be (loss tensor, {metric name: tensor})")
    for key, ref in value[1].items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(ref, _Ref):
            raise LossGraphError(
                f"metric {key!r} must be named custom/<name>:sum or custom/<name>:mean and be a tensor"
            )
    return value[0], value[1]


def _refers(value) -> bool:
    if isinstance(value, _Ref):
        return True
    if isinstance(value, (list, tuple)):
        return any(_refers(v) for v in value)
    if isinstance(value, dict):
        return any(_refers(v) for v in value.values())
    return isinstance(value, slice) and _refers([value.start, value.stop, value.step])


def _resolve(value, env: dict, device):
    if isinstance(value, _Ref):
        return env[value.name]
    if value is _DEVICE:
        return device
    if isinstance(value, list):
        return [_resolve(v, env, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env, device) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env, device) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_resolve(v, env, device) for v in (value.start, value.stop, value.step)))
    return value


def run_per_datum(program: LossProgram, logprobs: list[torch.Tensor], inputs: list[list[torch.Tensor]]):
    """Sum of the per-datum losses, and metrics reduced by suffix (`:sum` summed, `:mean` averaged over
    datums) — the SDK's `run_loss_handle`, so server and client-side runs agree."""
    total, sums = None, {}
    for lp, args in zip(logprobs, inputs, strict=True):
        loss, metrics = program(lp, *args)
        total = loss if total is None else total + loss
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value.detach().item())
    return total, {k: v / len(logprobs) if k.endswith(":mean") else v for k, v in sums.items()}
