"""When a request stops: after each generated token, its stop tokens (EOS unless ignored, and the user's, past
min_tokens), its stop strings (the detokenizer's check), max_tokens and max_model_len, in that order (as vLLM)."""

from __future__ import annotations

from shardserve.cluster.request import Request


def check_stop(seq: Request, n: int, max_model_len: int) -> str | None:
    """The stop checks after the request's n-th generated token: "stop" (a stop token or string), "length"
    (max_tokens, or the context at max_model_len) or None."""
    token = seq.output_token_ids[n - 1]
    min_tokens = seq.params.min_tokens
    # The workers mask stop ids for the first min_tokens tokens; the check here mirrors that.
    if token in seq.stop_token_set and n > min_tokens:
        if token in seq.params.stop_token_ids:  # a user stop token is reported; EOS is not (as vLLM)
            seq.stop_reason = token
        if seq.detokenizer is not None and seq.params.include_stop_str_in_output:
            seq.detokenizer.add_token(token, check_stop=False)  # its text (none for a skipped special token)
        return "stop"  # the stop token stays in token_ids; its text is added only with include_stop_str_in_output
    if seq.detokenizer is not None and seq.detokenizer.add_token(token, check_stop=n >= min_tokens):
        seq.stop_reason = seq.detokenizer.stopped_by
        return "stop"
    if n >= seq.params.max_tokens or seq.num_prompt_tokens + n >= max_model_len:
        return "length"
    return None
