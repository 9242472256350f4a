"""The decoder every model shares (Llama 2/3, SmolLM2, Mistral-style dense, Qwen2, Qwen3), with its knobs.

The models are the same network with small differences, expressed as a `DecoderVariant`: Qwen2 adds a bias to
q/k/v; Qwen3 RMS-normalises each q/k head before RoPE. Module names follow HF checkpoints
(model.layers.N.self_attn.qkv_proj, mlp.gate_up_proj, ...) so the loader's mapping is short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardserve.kernels.backends import AttentionBackend, AttentionMetadata
from shardserve.proto.stages import PipelineStage
from shardserve.worker.distributed import tp_size
from shardserve.worker.layers import _fused
from shardserve.worker.layers.activation import SiluAndMul
from shardserve.worker.layers.attention import Attention
from shardserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.worker.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                             quantize_linear_weights)
from shardserve.worker.layers.norm import RMSNorm
from shardserve.worker.layers.rotary import RotaryEmbedding, rope_settings


@dataclass(frozen=True)
class DecoderVariant:
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on o_proj
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, hf_config: Any, variant: DecoderVariant, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, hf_config.num_attention_heads, hf_config.num_key_value_heads, bias=variant.qkv_bias
        )
        heads, kv_heads = self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim, hidden, bias=variant.o_bias)
        self.rotary = rotary  # one instance shared by all layers: one cos/sin cache
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps) if variant.qk_norm else None
        self.attn = Attention(heads, kv_heads, self.head_dim, self.head_dim**-0.5, backend)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), kv_cache, meta))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """The qkv projection's output [T, (q + 2 kv) * head_dim] -> attention's [T, heads * head_dim] (before
        o_proj): q/k norm, RoPE, the KV store and attention."""
        tokens = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.reshape(tokens, -1, self.head_dim)
        k = k.reshape(tokens, -1, self.head_dim)
        if _fused.use_fused(qkv):  # one kernel: (q/k norm and) RoPE, in place in the qkv output, and the KV store
            from shardserve.kernels.rope import apply_rope_

            norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else None
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            whole_head = 2 * self.rotary.cos_cache.shape[1] == self.head_dim  # the store needs every dim rotated
            write = self.attn.kv_write(v, kv_cache, meta) if whole_head else None
            apply_rope_(positions, q, k, self.rotary.cos_cache, self.rotary.sin_cache, norms, eps, write)
            return self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, kv_cache, meta, stored=write is not None)
        if self.q_norm is None and not qkv.is_cuda:  # q and k heads are side by side in qkv: rotated in place
            heads = q.shape[1] + k.shape[1]
            self.rotary.rotate_(positions, qkv[:, : heads * self.head_dim].view(tokens, heads, self.head_dim))
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        return self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, kv_cache, meta)


class DecoderMLP(nn.Module):
    def __init__(self, hf_config: Any, variant: DecoderVariant) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        inter = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, [inter, inter], bias=variant.mlp_bias,
                                                       gated=True)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, bias=variant.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.silu_and_mul(x)
        return self.down_proj(h if h is not None else self.act(self.gate_up_proj(x)))


# The one-row layer's GEMV tiles (block_n x block_k), the fastest timed (docs/performance-history.md): bf16 weights 8 x 1,024 but o_proj 4 x 2,048; e4m3 weights (products summed 8 at a time)
# 8 x 2,048 for qkv and down, 8 x 1,024 for o_proj and gate_up.
_TILES = {"qkv": {}, "o_proj": dict(block_n=4, block_k=2048), "gate_up": {}, "down": {}}
_FP8_TILES = {"qkv": dict(block_k=2048), "o_proj": {}, "gate_up": {}, "down": dict(block_k=2048)}


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, variant: DecoderVariant, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(hf_config, variant, rotary, backend)
        self.mlp = DecoderMLP(hf_config, variant)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.one_row_ok = not (variant.o_bias or variant.mlp_bias)  # forward_one_row adds no bias after o_proj/down

    def forward(self, positions, x, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) -> (x, residual) of the next layer; residual None: x is the whole residual stream."""
        if residual is None and self.one_row_ok and _fused.one_row(x):
            return self.forward_one_row(positions, x, kv_cache, meta), None
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_one_row(self, positions, h, kv_cache, meta) -> torch.Tensor:
        """One token through the layer as four GEMVs and attention (kernels/gemv.py: gemv_fused): the norms read
        inside the qkv and gate_up GEMVs, SiLU-and-mul inside the down one, the residual adds in o_proj's and down's
        outputs. h is the residual stream in and out; the same values as forward, in 5 launches fewer."""
        from shardserve.kernels.gemv import gemv_fused

        attn, mlp = self.self_attn, self.mlp
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        tiles = _FP8_TILES if attn.qkv_proj.weight_scale is not None else _TILES
        qkv = gemv_fused(h, attn.qkv_proj.weight, norm=(norm_in.weight, norm_in.eps),
                         weight_scale=attn.qkv_proj.weight_scale, **tiles["qkv"])
        if attn.qkv_proj.bias is not None:
            qkv = qkv + attn.qkv_proj.bias
        h = gemv_fused(attn.attend(positions, qkv, kv_cache, meta), attn.o_proj.weight, residual=h,
                       weight_scale=attn.o_proj.weight_scale, **tiles["o_proj"])
        gate_up = gemv_fused(h, mlp.gate_up_proj.weight, norm=(norm_post.weight, norm_post.eps),
                             weight_scale=mlp.gate_up_proj.weight_scale, **tiles["gate_up"])
        return gemv_fused(gate_up, mlp.down_proj.weight, silu=True, residual=h, weight_scale=mlp.down_proj.weight_scale,
                          **tiles["down"])


class OtherStageLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no weights, so checkpoint names keep their indices."""


class DecoderModel(nn.Module):
    def __init__(self, hf_config: Any, variant: DecoderVariant, backend: AttentionBackend,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        num_layers = hf_config.num_hidden_layers
        self.stage = stage if stage is not None else PipelineStage(0, 1, 0, num_layers)
        first, end = self.stage.first_layer, self.stage.end_layer
        theta, scaling = rope_settings(hf_config)
        rotary = RotaryEmbedding(head_dim_of(hf_config), hf_config.max_position_embeddings, theta, scaling)
        self.rotary = rotary
        # The last stage keeps a tied embedding's weight for its LM head (one Parameter either way).
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.stage.is_first or (self.stage.is_last and tied):
            self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, variant, rotary, backend) if first <= i < end else OtherStageLayer()
            for i in range(num_layers)
        )
        if self.stage.is_last:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.stage_layers: tuple[DecoderLayer, ...] = tuple(self.layers[first:end])  # (registered in self.layers)

    def forward(self, input_ids, positions, kv_caches, meta, carried=None):
        """The stage's layers: from the token embedding (the first stage) or from `carried`, the previous stage's
        (hidden states, residual). The last stage returns the normed hidden states, any other its (x, residual)."""
        if carried is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = carried
        for layer, kv_cache in zip(self.stage_layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        if not self.stage.is_last:
            return x, residual
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The decoder with its LM head; a model class (llama.py, qwen2.py, qwen3.py) only chooses its DecoderVariant."""

    @classmethod
    def variant_for(cls, hf_config: Any) -> DecoderVariant:
        raise NotImplementedError

    def __init__(self, hf_config: Any, backend: AttentionBackend, stage: PipelineStage | None = None) -> None:
        super().__init__()
        tp = tp_size()
        if hf_config.num_attention_heads % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide num_attention_heads ({hf_config.num_attention_heads})"
            )
        self.model = DecoderModel(hf_config, self.variant_for(hf_config), backend, stage)
        self.stage = self.model.stage
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.stage.is_last:  # the LM head and the sampler live on the last pipeline stage only
            tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tied_to=tied_to)
        layers = self.model.stage_layers
        qkv = layers[0].self_attn.qkv_proj if layers else None
        self.num_layers = len(layers)  # this stage's: its KV cache holds these
        self.head_dim = head_dim_of(hf_config)
        self.num_kv_heads_per_rank = qkv.num_kv_heads_per_rank if qkv is not None else 0
        self.vocab_size = hf_config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        carried: tuple[torch.Tensor, torch.Tensor] | None = None,  # a later pipeline stage's input (stage_link.py)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, hidden]; (x, residual) before the last stage
        return self.model(input_ids, positions, kv_caches, meta, carried)

    def holds_checkpoint_tensor(self, name: str) -> bool:
        """False for a checkpoint tensor that another pipeline stage loads (its layers, embedding, norm, LM head)."""
        stage = self.stage
        if stage.count == 1:
            return True
        if name.startswith("model.layers."):
            return stage.first_layer <= int(name.split(".", 3)[2]) < stage.end_layer
        if name.startswith("model.embed_tokens."):
            return hasattr(self.model, "embed_tokens")
        if name.startswith(("model.norm.", "lm_head.")):
            return stage.is_last
        return True

    def quantize_weights_fp8(self) -> None:
        """quantization="fp8": every decoder linear layer's weight to e4m3 with per-channel scales
        (worker/layers/linear.py), and the norms in front of qkv and gate_up hand them quantized rows. (SiLU-and-mul
        does not: its kernel spreads a row over many programs; one program a row, to find the row's scale in the
        same pass, was slower than the two launches.)"""
        quantize_linear_weights(self)
        for layer in self.model.stage_layers:  # (the one-row layer's GEMVs read the e4m3 weights themselves: gemv.py)
            layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] in the model dtype, the full vocabulary on every rank."""
        return self.lm_head(hidden)
