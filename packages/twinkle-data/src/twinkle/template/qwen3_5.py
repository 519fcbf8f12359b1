"""Qwen3_5Template: twinkle-kit's name for the Qwen3.5 / Qwen-VL chat format, on our Template.

Every twinkle-kit script names it. The chat format itself is the checkpoint's own chat template (as for
`Template`); what the name adds is the Qwen-VL vision handling: the model's image processor turns each
image into a grid of patches (`patch_size` pixels, `merge_size`² patches merged into one token), every
`<|image_pad|>` placeholder is expanded to that many tokens (`twinkle.template.vision`), and
`vllm_input_ids` folds each expanded run back into one placeholder, the prompt form vLLM's multimodal
input takes (vLLM expands it again from the image itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinkle.template.template import TEMPLATES, Template

if TYPE_CHECKING:
    from twinkle.template.vision import ImageEncoder


@TEMPLATES.register
class Qwen3_5Template(Template):
    aliases = ("qwen3_5",)

    def _vision(self) -> ImageEncoder | None:
        """The image encoder of a vision-language checkpoint (loaded on first use); None for text models."""
        if self._image_encoder is None and self._model_path is not None and not self._probed_images:
            from twinkle.template import vision

            self._probed_images = True
            self._image_encoder = vision.load_image_encoder(self._model_path, self.tokenizer)
        return self._image_encoder

    @property
    def is_vision(self) -> bool:
        return self._vision() is not None

    @property
    def patch_size(self) -> int | None:
        """Pixels per side of one vision patch (None for a text-only checkpoint)."""
        encoder = self._vision()
        return None if encoder is None or encoder.patch_size is None else int(encoder.patch_size)

    @property
    def merge_size(self) -> int | None:
        """Patches per side merged into one image token (None for a text-only checkpoint)."""
        encoder = self._vision()
        return None if encoder is None else int(encoder.merge)

    def vllm_input_ids(self, input_ids: list[int]) -> list[int]:
        """`input_ids` with every run of image placeholder tokens folded into one placeholder."""
        encoder = self._vision()
        if encoder is None:
            return list(input_ids)
        pad, out = encoder.token_id, []
        for token in input_ids:
            if token == pad and out and out[-1] == pad:
                continue
            out.append(int(token))
        return out

    get_vllm_input_ids = vllm_input_ids  # twinkle-kit's name
