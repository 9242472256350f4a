"""LlamaForCausalLM (Llama 2/3, SmolLM2; dense Mistral is the same network): the shared decoder (decoder.py) with
bias on the attention projections and the MLP only where the checkpoint's config asks for it."""

from __future__ import annotations

from typing import Any

from shardserve.worker.models.decoder import DecoderForCausalLM, DecoderVariant


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def variant_for(cls, hf_config: Any) -> DecoderVariant:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return DecoderVariant(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=mlp_bias, qk_norm=False)
