"""The model architectures shardserve runs, by the name config.json gives them. The names live here, apart from
registry.py (which builds the classes and needs torch), so a config can be checked without importing torch."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
