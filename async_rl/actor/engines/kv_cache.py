"""The torch engine's KV cache: transformers' DynamicCache with room reserved for the
response, so that a decoding step writes its new keys and values in place.

DynamicCache grows each layer by `torch.cat` at every step, copying the whole cache of
every layer once per token: for a small model with a long chat prompt that copy costs
as much as a tenth of the step. Once the prompts are prefilled, `reserve(n)` moves each
full-attention layer into buffers with `n` free positions; later steps write into them and
the layer exposes views of the filled part. Layers of other kinds (sliding window, linear
attention) keep transformers' own behaviour.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A DynamicLayer that, once `reserve`d, appends into preallocated buffers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def reserve(self, extra: int) -> None:
        if not self.is_initialized or self.keys.numel() == 0:
            return
        filled = self.keys.shape[-2]
        self._key_buffer = _grown(self.keys, filled + extra)
        self._value_buffer = _grown(self.values, filled + extra)
        self._show(filled)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._key_buffer is None:
            return super().update(key_states, value_states, *args, **kwargs)
        start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:  # past the reservation: back to concatenation
            self.keys, self.values = self.keys.contiguous(), self.values.contiguous()
            self._key_buffer = self._value_buffer = None
            return super().update(key_states, value_states, *args, **kwargs)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self._show(end)
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._key_buffer is None:
            return super().batch_repeat_interleave(repeats)
        filled = self.keys.shape[-2]
        self._key_buffer = self._key_buffer.repeat_interleave(repeats, dim=0)
        self._value_buffer = self._value_buffer.repeat_interleave(repeats, dim=0)
        self._show(filled)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._key_buffer is None:
            return super().batch_select_indices(indices)
        filled = self.keys.shape[-2]
        self._key_buffer, self._value_buffer = self._key_buffer[indices], self._value_buffer[indices]
        self._show(filled)

    def _show(self, filled: int) -> None:
        self.keys = self._key_buffer[:, :, :filled]
        self.values = self._value_buffer[:, :, :filled]


def _grown(states: torch.Tensor, length: int) -> torch.Tensor:
    buffer = states.new_empty(*states.shape[:-2], length, states.shape[-1])
    buffer[:, :, : states.shape[-2]] = states
    return buffer


class ReservingCache(DynamicCache):
    """DynamicCache whose full-attention layers can reserve room for the next tokens."""

    def __init__(self, config: object | None = None) -> None:
        super().__init__(config=config)
        if not self.layers:  # no config: layers are made on first use, of this class
            self.layer_class_to_replicate = ReservedLayer
        self.layers = [ReservedLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]

    def reserve(self, extra: int) -> None:
        """Room for `extra` more positions in every full-attention layer filled so far."""
        for layer in self.layers:
            if isinstance(layer, ReservedLayer):
                layer.reserve(extra)
