"""Qwen2ForCausalLM: the shared decoder with a bias on the q/k/v projections (none on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from shardserve.worker.models.decoder import DecoderForCausalLM, DecoderVariant


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def variant_for(cls, hf_config: Any) -> DecoderVariant:
        return DecoderVariant(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
