"""Server-side custom losses: `create_custom_loss` stores a traced loss; `forward_backward` with
`loss_fn="custom"` runs it, in the one request the SDK sends, as an engine `Loss` inside the pass
(tinker/program_loss.py): one model pass and one HTTP round trip instead of the fallback's two each.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from twinkle.serve.core.service import Service
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.tinker.bodies import CreateCustomLossBody
from twinkle.serve.tinker.custom_loss import LossGraphError, LossProgram
from twinkle.serve.tinker.datums import Datum
from twinkle.serve.tinker.program_loss import ProgramLoss


def create(svc: Service, tenant: str, body: CreateCustomLossBody) -> dict:
    """POST /create_custom_loss: validate the graph now (a 400 names what is wrong), store it, answer a
    future that is already complete with its `loss_id`."""
    svc.session(tenant, body.session_id)
    try:
        LossProgram.parse(body.name, body.inputs, body.graph)
    except LossGraphError as e:
        raise BadRequest(f"create_custom_loss {body.name!r}: {e}") from None
    loss_id = f"{body.session_id}:loss:{body.custom_loss_seq_id}"
    svc.store.custom_losses.put(loss_id, tenant, body.session_id, body.name, body.inputs, body.graph)
    request_id = svc.rt.hub.create(tenant)
    svc.rt.hub.complete_json(request_id, {"type": "create_custom_loss", "loss_id": loss_id})
    return {"request_id": request_id}


class Programs:
    """Parsed custom losses, so a training request does not parse its loss's graph again: a bounded
    memo over the store's rows (which stay the truth, and survive a restart)."""

    def __init__(self, svc: Service, capacity: int = 256):
        self.svc, self.capacity = svc, capacity
        self._parsed: OrderedDict[tuple, LossProgram] = OrderedDict()

    def get(self, tenant: str, session_id: str, loss_id) -> LossProgram:
        table = self.svc.store.custom_losses
        stamp = table.stamp(loss_id, tenant)
        if stamp is None or stamp[0] != session_id:  # a handle works only in the session that made it
            raise NotFound(f"custom loss {loss_id!r} not found in session {session_id!r}")
        key = (tenant, loss_id, stamp[1])  # created_at: a loss stored again under its id is parsed again
        program = self._parsed.pop(key, None)
        if program is None:
            row = table.owned(loss_id, tenant)
            assert row is not None  # stamped just above
            program = LossProgram.parse(row["name"], row["inputs"], row["graph"])
        self._parsed[key] = program
        while len(self._parsed) > self.capacity:
            self._parsed.popitem(last=False)
        return program


def prepare(program: LossProgram, data: list[Datum]) -> tuple[list[Datum], ProgramLoss]:
    """(the datums the pass scores: tokens and targets only, the engine `Loss` that runs `program` on
    them with each datum's own inputs as tensors of their declared rank)."""
    inputs, scored = [], []
    for i, d in enumerate(data):
        if "target_tokens" not in d.inputs:
            raise BadRequest(
                f"datum {i} has no loss_fn_inputs['target_tokens'], which loss {program.name!r} needs for its logprobs"
            )
        targets = d.inputs["target_tokens"]
        if targets.ndim != program.inputs[0][1]:
            raise BadRequest(
                f"datum {i} loss_fn_inputs['target_tokens'] has shape {list(targets.shape)}, but loss "
                f"{program.name!r} declared logprobs with rank {program.inputs[0][1]} (the targets' rank)"
            )
        row = []
        for name, rank in program.inputs[1:]:
            if name not in d.inputs:
                raise BadRequest(f"datum {i} has no loss_fn_inputs[{name!r}], which loss {program.name!r} takes")
            arr = d.inputs[name]
            if rank == 0 and arr.size == 1 and arr.ndim <= 1:
                arr = arr.reshape(())
            elif rank == 1 and arr.ndim <= 1:
                arr = arr.reshape(-1)
            elif not (rank == 2 and arr.ndim == 2):
                raise BadRequest(
                    f"datum {i} loss_fn_inputs[{name!r}] has shape {list(arr.shape)}, but loss "
                    f"{program.name!r} declared {name} with rank {rank}"
                )
            row.append(torch.from_numpy(arr.copy()))  # the body's buffer is read-only
        inputs.append(row)
        scored.append(Datum(d.tokens, {"target_tokens": targets}, d.images))
    widths = [int(d.inputs["target_tokens"].shape[1]) if program.inputs[0][1] == 2 else None for d in data]
    return scored, ProgramLoss(program, inputs, widths)
