"""What twinkle_client's proxies do on this machine before a call: loss inputs merged into the rows,
chats encoded with a local template. Both use twinkle-data (`pip install 'twinkle-client[local-encoding]'`);
without it, only what needs neither works."""

from __future__ import annotations

from typing import Any


class BaseModelReference:
    """What forward_only(disable_lora=True) returns over HTTP: the base model's log-probs, taken by the
    server inside the loss (the adapter switched off) instead of sent back and forth."""

    def __getitem__(self, key):
        raise KeyError(
            f"{key!r}: over HTTP the base model's log-probs stay on the server, where the loss reads them; "
            "pass this object to forward_backward(ref_outputs=...)"
        )

    def __repr__(self) -> str:
        return "BaseModelReference(computed by the server's loss)"


BASE_MODEL_REFERENCE = BaseModelReference()


def _data_layer(what: str):
    try:
        import twinkle.data_format as data_format
    except ImportError as e:
        raise ImportError(f"{what} needs twinkle-data here: pip install 'twinkle-client[local-encoding]'") from e
    return data_format


def with_loss_inputs(inputs, old_logps=None, advantages=None, ref_outputs=None):
    """`inputs` with the loss-input keywords as row fields (twinkle.data_format.merge_loss_inputs)."""
    reference = getattr(ref_outputs, "result", ref_outputs)
    if isinstance(reference, BaseModelReference):
        reference = None  # the server's loss takes the base model's log-probs itself
    if old_logps is None and advantages is None and reference is None:
        return inputs
    merge = _data_layer("forward_backward(old_logps= / advantages= / ref_outputs=)").merge_loss_inputs
    return merge(inputs, old_logps=old_logps, advantages=advantages, ref_outputs=reference)


def local_template(template_cls, model_id: str | None, kwargs: dict[str, Any]):
    """A twinkle Template (by registered name or class) for `model_id`, built on this machine."""
    _data_layer("set_template")
    from twinkle.template import TEMPLATES, Template

    if isinstance(template_cls, Template):
        return template_cls
    if model_id is None:
        raise ValueError("set_template needs model_id= (the model whose tokenizer encodes the chats)")
    return TEMPLATES.get(template_cls)(model_id=model_id, **kwargs)
