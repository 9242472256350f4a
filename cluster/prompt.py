"""A request's prompt as the client API gives it (text, token ids or chat messages) -> the engine's token ids.

It runs on the engine thread (cluster/engine_loop.py), where the tokenizer lives: HF fast tokenizers must not be
used from two threads at once.
"""

from __future__ import annotations

from shardserve.cluster.engine import Engine
from shardserve.cluster.sampling_params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages ({"role", "content"})


def admit(engine: Engine, req_id: str, prompt: Prompt, params: SamplingParams) -> int:
    """Runs on the engine thread (the tokenizer lives there): encodes the prompt and adds the request.
    Returns the prompt's token count; raises ValueError for bad input."""
    tokenizer = engine.tokenizer
    text = None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): send token ids")
        if not prompt:
            raise ValueError("prompt must not be empty")
        text, ids = prompt, tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: send text or token ids")
        for m in prompt:
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"chat roles must be one of {', '.join(CHAT_ROLES)}; got {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise ValueError("every chat message needs a string content")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, list):
        ids = prompt  # checked by add_request: non-empty, integers within the vocabulary
    else:
        raise ValueError(f"a prompt is text, token ids or chat messages; got {type(prompt).__name__}")
    engine.add_request(req_id, ids, params, prompt=text)
    return len(ids)
