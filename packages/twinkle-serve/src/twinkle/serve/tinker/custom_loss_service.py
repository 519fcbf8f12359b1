"""Server-side custom losses: `create_custom_loss` stores a traced loss; `forward_backward` with
`loss_fn="custom"` runs it, in the one request the SDK sends.

The computation is the SDK's client-side fallback, moved here: a forward pass for the target
logprobs, the interpreted loss on them, its gradient `g = dLoss/dlogprobs`, then a cross-entropy
backward with weights `-g` (whose gradient is exactly `dLoss/dθ`). Same numbers as the fallback,
one HTTP round trip instead of two.
"""

from __future__ import annotations

import numpy as np
import torch

from twinkle.serve.backend import Datum, ForwardResult, UserError
from twinkle.serve.core.records import Run
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import Answer
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.limits import Hold
from twinkle.serve.tinker import codec
from twinkle.serve.tinker import wire_proto as pb
from twinkle.serve.tinker.custom_loss import LossGraphError, LossProgram, run_per_datum


def create(svc: Service, tenant: str, body: dict) -> dict:
    """POST /create_custom_loss: validate the graph now (a 400 names what is wrong), store it, answer a
    future that is already complete with its `loss_id`."""
    session_id, seq = body.get("session_id"), body.get("custom_loss_seq_id")
    svc.session(tenant, session_id)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise BadRequest(f"custom_loss_seq_id must be an integer >= 0, got {seq!r}")
    try:
        LossProgram.parse(body.get("name"), body.get("inputs"), body.get("graph"))
    except LossGraphError as e:
        raise BadRequest(f"create_custom_loss {body.get('name')!r}: {e}") from None
    loss_id = f"{session_id}:loss:{seq}"
    svc.store.custom_losses.put(loss_id, tenant, str(session_id), str(body["name"]), body["inputs"], body["graph"])
    request_id = svc.rt.hub.create(tenant)
    svc.rt.hub.complete_json(request_id, {"type": "create_custom_loss", "loss_id": loss_id})
    return {"request_id": request_id}


def _program(svc: Service, tenant: str, session_id: str, loss_id) -> LossProgram:
    row = svc.store.custom_losses.owned(loss_id, tenant)
    if row is None or row["session_id"] != session_id:  # a handle works only in the session that made it
        raise NotFound(f"custom loss {loss_id!r} not found in session {session_id!r}")
    return LossProgram.parse(row["name"], row["inputs"], row["graph"])


def _loss_inputs(program: LossProgram, body: bytes, data: list[Datum]) -> list[list[torch.Tensor]]:
    """Each datum's loss inputs as tensors of their declared rank (the wire shape, which codec flattens)."""
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)  # already parsed once by codec: valid
    out = []
    for i, (d, wire) in enumerate(zip(data, msg.data)):
        if "target_tokens" not in d.inputs:
            raise BadRequest(
                f"datum {i} has no loss_fn_inputs['target_tokens'], which loss {program.name!r} needs for its logprobs"
            )
        row = []
        for name, rank in program.inputs[1:]:
            if name not in d.inputs:
                raise BadRequest(f"datum {i} has no loss_fn_inputs[{name!r}], which loss {program.name!r} takes")
            arr, shape = d.inputs[name], list(wire.loss_fn_inputs[name].shape)
            if rank == 0 and arr.size == 1 and len(shape) <= 1:
                arr = arr.reshape(())
            elif rank == 1 and len(shape) <= 1:
                arr = arr.reshape(-1)
            elif rank == 2 and len(shape) == 2:
                arr = arr.reshape(shape)
            else:
                raise BadRequest(
                    f"datum {i} loss_fn_inputs[{name!r}] has shape {shape or [arr.size]}, but loss "
                    f"{program.name!r} declared {name} with rank {rank}"
                )
            row.append(torch.from_numpy(arr.copy()))
        out.append(row)
    return out


def submit(
    svc: Service,
    tenant: str,
    engine,
    run: Run,
    seq_id,
    data: list[Datum],
    config: dict,
    forward_only: bool,
    body: bytes,
    hold: Hold | None = None,
) -> str:
    """Queue one custom-loss forward(/backward) for `run`; the id of its future (a ForwardBackwardOutput)."""
    program = _program(svc, tenant, run.session_id, config.get("loss_id"))
    inputs = _loss_inputs(program, body, data)
    tokens = sum(len(d.tokens) for d in data)
    surrogate = [
        Datum(
            d.tokens,
            {"target_tokens": d.inputs["target_tokens"], "weights": np.zeros(len(d.tokens), np.float32)},
            d.images,
        )
        for d in data
    ]

    def work():
        adapter = svc.live_adapter(run.model_id)
        forward = engine.backend.forward_backward(adapter, surrogate, "cross_entropy", {}, True)
        logprobs = [torch.from_numpy(np.array(lp, np.float32)).requires_grad_(True) for lp in forward.logprobs]
        try:
            with torch.enable_grad():
                loss, metrics = run_per_datum(program, logprobs, inputs)
                loss_sum = float(loss.detach().sum())
                if forward_only:
                    svc.count_training(run, tokens)
                    return Answer.proto(
                        codec.encode_forward_result(ForwardResult(forward.logprobs, {**metrics, "loss:sum": loss_sum}))
                    )
                loss.backward()
        except LossGraphError as e:
            raise UserError(str(e)) from None
        linear = []
        for i, (d, lp) in enumerate(zip(surrogate, logprobs)):
            if lp.grad is None:
                raise UserError(f"loss {program.name!r} does not depend on the logprobs of datum {i}: no gradient")
            # cross-entropy is L = -sum(w * logprobs): w = -dLoss/dlogprobs back-propagates the custom loss
            weights = (-lp.grad).numpy()
            linear.append(Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"], "weights": weights}, d.images))
        backward = engine.backend.forward_backward(adapter, linear, "cross_entropy", {}, False)
        svc.count_training(run, tokens)
        svc.record_step(run, {"loss": loss_sum})  # the run's curve, as for the built-in losses
        surrogate_sum = backward.metrics.pop("loss:sum")
        out = {**backward.metrics, **metrics, "loss:sum": loss_sum, "surrogate_loss:sum": surrogate_sum}
        return Answer.proto(codec.encode_forward_result(ForwardResult(backward.logprobs, out)))

    return svc.submit(tenant, engine, run.model_id, seq_id, work, hold=hold)
