"""From what a user asks for to a running engine's settings: the resolved EngineConfig (resolve.py), where a model
comes from (model_source.py: the default model, a folder, a .gguf file, a built-in config) and the one wiring of an
Engine (engine_factory.py)."""
