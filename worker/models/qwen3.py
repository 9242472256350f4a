"""Qwen3ForCausalLM: the shared decoder with per-head RMSNorm on q and k before RoPE, and no q/k/v bias by default."""

from __future__ import annotations

from typing import Any

from shardserve.worker.models.decoder import DecoderForCausalLM, DecoderVariant


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def variant_for(cls, hf_config: Any) -> DecoderVariant:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderVariant(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True)
