"""Shared-prefix scoring that computes only what the answer logits need.

A judge score needs the next-token distribution at one position per criterion: the last
token of each criterion suffix. A plain forward computes every layer at every position.
Here the model's own modules (embedding, norms, projections, rotary embedding, MLPs, head)
run in a loop of our own, for Llama-style decoders (:data:`SUPPORTED_MODEL_TYPES`):

- **the prefix** runs every layer but the last in full (causal attention, no mask); of
  the last layer it needs only the keys and values, which the suffix tokens attend to;
- **the packed suffixes** (all criterion suffixes end to end in one row, block-causal
  mask, positions continuing the prefix's: see ``hf.SuffixLayout``) run every layer but
  the last in full over the prefix's keys and values; the last layer's keys and values
  cover every suffix token, but its queries, attention output, MLP, the final norm and
  the LM head run only at the C answer positions.

Nothing is cached or copied between items: the prefix's keys and values are plain
tensors handed to the suffix pass. With L layers the last layer's attention and MLP run
on C positions instead of prefix + suffix tokens, and no per-forward bookkeeping of
``transformers`` (mask building, cache objects, output records) remains.

The arithmetic is the decoder layer's own, module by module, so the scores equal the
transformers forward within float rounding (tests/test_judge_pruned_forward.py holds it to
the stated bound, per architecture). A model type not listed, or a variant this loop does
not reproduce (sliding-window attention, query/key norms, a tensor-parallel split),
makes :func:`pruned_forward_for` return None and the backend uses the transformers
forward instead.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Sequence

from calibrl.judge_server.backends.masks import aligned_for_kernels

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor
    from transformers import PreTrainedModel

    from calibrl.judge_server.backends.hf import SuffixLayout

    Rotary = tuple[Tensor, Tensor]  # (cos, sin) of the rotary embedding at each position

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "num_key_value_groups")


def unsupported_reason(model: "PreTrainedModel") -> str | None:
    """Why :class:`PrunedForward` cannot reproduce this model's forward, or None if it can."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) != 1:
        return "sliding-window attention or pretraining_tp > 1"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model has no model.embed_tokens/layers/norm/rotary_emb"
    for layer in inner.layers:
        attention = getattr(layer, "self_attn", None)
        if not all(hasattr(layer, name) for name in _LAYER_MODULES) or not all(
                hasattr(attention, name) for name in _ATTENTION_MODULES):
            return f"a decoder layer ({type(layer).__name__}) lacks the Llama modules"
        if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return "query/key norms"
    return None


def pruned_forward_for(model: "PreTrainedModel") -> "PrunedForward | None":
    return None if unsupported_reason(model) else PrunedForward(model)


class PrunedForward:
    """:meth:`item_logprobs` computes one item's answer log-probabilities (module doc)."""

    def __init__(self, model: "PreTrainedModel") -> None:
        import torch

        self._torch = torch
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers[: model.config.num_hidden_layers])
        # the half rotation of the model's own modelling module (Llama and Qwen2 rotate alike)
        self._rotate_half = inspect.getmodule(type(self.layers[0].self_attn)).rotate_half

    def item_logprobs(self, prefix: Sequence[int], layout: "SuffixLayout") -> "Tensor":
        """float32 (C, vocab) log-probabilities of the token after each criterion prompt of one
        item: ``prefix`` its token ids, ``layout`` the rubric's packed suffixes (``hf.SuffixLayout``)."""
        torch = self._torch
        ids = torch.tensor([list(prefix)], dtype=torch.long, device=layout.ids.device)
        keys, values = self._prefix_keys_values(ids)
        hidden = self._suffix_answer_states(layout, keys, values, len(prefix))
        logits = self.model.lm_head(self.inner.norm(hidden))[0]
        return torch.log_softmax(logits.float(), dim=-1)

    # ------------------------------------------------------------------ the two passes

    def _prefix_keys_values(self, ids: "Tensor") -> tuple[list["Tensor"], list["Tensor"]]:
        """Every layer's keys and values of the prefix, each (1, kv_heads, n, head_dim)."""
        torch = self._torch
        hidden = self.inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
        rotary = self.inner.rotary_emb(hidden, positions)
        keys, values = [], []
        for index, layer in enumerate(self.layers):
            normed = layer.input_layernorm(hidden)
            key, value = self._keys_values(layer.self_attn, normed, rotary)
            keys.append(key)
            values.append(value)
            if index == len(self.layers) - 1:
                break  # the last layer's output at prefix positions feeds nothing
            query = self._queries(layer.self_attn, normed, rotary)
            attended = self._attend(layer.self_attn, query, key, value, None)
            hidden = self._finish_layer(layer, hidden, attended)
        return keys, values

    def _suffix_answer_states(self, layout: "SuffixLayout", prefix_keys: list["Tensor"],
                              prefix_values: list["Tensor"], prefix_length: int) -> "Tensor":
        """(1, C, hidden) last-layer states at each suffix's last token (before the final norm)."""
        torch = self._torch
        hidden = self.inner.embed_tokens(layout.ids)
        rotary = self.inner.rotary_emb(hidden, layout.positions + prefix_length)
        mask = layout.mask(prefix_length)  # (1, 1, S, n + S) additive
        for index, layer in enumerate(self.layers):
            normed = layer.input_layernorm(hidden)
            key, value = self._keys_values(layer.self_attn, normed, rotary)
            key = torch.cat([prefix_keys[index], key], dim=2)
            value = torch.cat([prefix_values[index], value], dim=2)
            if index == len(self.layers) - 1:  # only the answer positions from here on
                hidden, normed = hidden[:, layout.last], normed[:, layout.last]
                mask = aligned_for_kernels(mask[:, :, layout.last])
                rotary = tuple(part[:, layout.last] for part in rotary)
            query = self._queries(layer.self_attn, normed, rotary)
            attended = self._attend(layer.self_attn, query, key, value, mask)
            hidden = self._finish_layer(layer, hidden, attended)
        return hidden

    # ------------------------------------------------------------------ one layer, as its modules compute it

    def _heads(self, attention: "torch.nn.Module", projected: "Tensor") -> "Tensor":
        batch, length, _ = projected.shape
        return projected.view(batch, length, -1, attention.head_dim).transpose(1, 2)

    def _rope(self, heads: "Tensor", rotary: "Rotary") -> "Tensor":
        """Rotary position embedding as ``apply_rotary_pos_emb`` applies it, to one tensor."""
        cos, sin = (part.unsqueeze(1) for part in rotary)
        return heads * cos + self._rotate_half(heads) * sin

    def _keys_values(self, attention: "torch.nn.Module", normed: "Tensor",
                     rotary: "Rotary") -> tuple["Tensor", "Tensor"]:
        key = self._rope(self._heads(attention, attention.k_proj(normed)), rotary)
        return key, self._heads(attention, attention.v_proj(normed))

    def _queries(self, attention: "torch.nn.Module", normed: "Tensor", rotary: "Rotary") -> "Tensor":
        return self._rope(self._heads(attention, attention.q_proj(normed)), rotary)

    def _attend(self, attention: "torch.nn.Module", query: "Tensor", key: "Tensor", value: "Tensor",
                mask: "Tensor | None") -> "Tensor":
        """(1, L, heads * head_dim): causal when ``mask`` is None (the prefix), else masked."""
        groups = attention.num_key_value_groups
        if groups > 1:  # grouped-query attention: each key/value head serves ``groups`` query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = self._torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=attention.scaling)
        return out.transpose(1, 2).reshape(query.shape[0], query.shape[2], -1)

    def _finish_layer(self, layer: "torch.nn.Module", hidden: "Tensor", attended: "Tensor") -> "Tensor":
        hidden = hidden + layer.self_attn.o_proj(attended)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
