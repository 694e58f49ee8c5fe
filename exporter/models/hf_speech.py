"""Whisper as one module with two methods over shared state (spike/PLAN.md, issue 43): `encode`
fills each decoder layer's cross-attention keys and values from the encoder, `forward` runs
decoder tokens at cache positions with a static self-attention cache, as StaticCacheLM does for
causal LMs. Both keep their state in buffers, so programs exported from one instance read and
write the same tensors (ExecuTorch shares them across methods with share_mutable_buffers;
AOTInductor's models packaged from them share them by construction)."""

from __future__ import annotations

import copy

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import WhisperForConditionalGeneration


class WhisperCacheLM(torch.nn.Module):
    def __init__(self, model: WhisperForConditionalGeneration, slots: int) -> None:
        super().__init__()
        config = model.config
        self.model = model
        self.slots = slots
        self.heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.heads
        frames = config.max_source_positions
        dtype = model.dtype
        for layer in range(config.decoder_layers):
            for name, length in (
                ("cross_keys", frames),
                ("cross_values", frames),
                ("keys", slots),
                ("values", slots),
            ):
                shape = (1, self.heads, length, self.head_dim)
                self.register_buffer(
                    f"{name}_{layer}", torch.zeros(shape, dtype=dtype), persistent=False
                )

    def encoder_view(self) -> torch.nn.Module:
        """This module with `encode` as its forward, over the same parameters and buffers under
        the same names: what torch.export takes for the encode method, so that both programs
        name their shared state alike."""
        view = copy.copy(self)
        view.__class__ = _EncodeView
        return view

    def _split(self, states: torch.Tensor) -> torch.Tensor:
        return states.view(1, -1, self.heads, self.head_dim).transpose(1, 2)

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """The encoder's states of one clip, its keys and values written for every layer's
        cross-attention."""
        states = self.model.model.encoder(input_features).last_hidden_state
        for index, layer in enumerate(self.model.model.decoder.layers):
            attention = layer.encoder_attn
            getattr(self, f"cross_keys_{index}").copy_(self._split(attention.k_proj(states)))
            getattr(self, f"cross_values_{index}").copy_(self._split(attention.v_proj(states)))
        return states

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        decoder = self.model.model.decoder
        seq = input_ids.shape[1]
        hidden = decoder.embed_tokens(input_ids) + decoder.embed_positions.weight[cache_position]
        # Each query sees the slots up to its own position.
        visible = (
            torch.arange(self.slots, device=input_ids.device)[None, :] <= cache_position[:, None]
        )
        for index, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            normed = layer.self_attn_layer_norm(hidden)
            # Whisper scales the queries before the product (transformers' WhisperAttention).
            query = self._split(attention.q_proj(normed) * attention.scaling)
            keys, values = getattr(self, f"keys_{index}"), getattr(self, f"values_{index}")
            keys.index_copy_(2, cache_position, self._split(attention.k_proj(normed)))
            values.index_copy_(2, cache_position, self._split(attention.v_proj(normed)))
            attended = scaled_dot_product_attention(
                query, keys, values, attn_mask=visible, scale=1.0
            )
            hidden = hidden + attention.out_proj(attended.transpose(1, 2).reshape(1, seq, -1))
            cross = layer.encoder_attn
            query = self._split(cross.q_proj(layer.encoder_attn_layer_norm(hidden)) * cross.scaling)
            attended = scaled_dot_product_attention(
                query,
                getattr(self, f"cross_keys_{index}"),
                getattr(self, f"cross_values_{index}"),
                scale=1.0,
            )
            hidden = hidden + cross.out_proj(attended.transpose(1, 2).reshape(1, seq, -1))
            normed = layer.final_layer_norm(hidden)
            hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(normed)))
        return self.model.proj_out(decoder.layer_norm(hidden))


class _EncodeView(WhisperCacheLM):
    forward = WhisperCacheLM.encode
