"""How a broken stream is sent again: whether it may be (greedy, seeded, or with the seed the server told), and the
request it resends (shardserve/client/clients.py's module docstring says when and why that is exact)."""

from __future__ import annotations

from shardserve.proto import generation_pb2 as pb


def _reopen_request(request: pb.GenerateRequest, received: list[int], seed: int | None,
                    had_prompt_logprobs: bool) -> pb.GenerateRequest:
    """The request sent again: a new id (the old one may still be known to the server), the tokens received, the
    seed the server told (an unseeded request continues its draw), no prompt logprobs when they came already."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.ClearField("request_id")
    if seed is not None and not again.HasField("seed"):
        again.seed = seed
    if had_prompt_logprobs:
        again.ClearField("prompt_logprobs")
    del again.resume_token_ids[:]
    again.resume_token_ids.extend(received)
    return again


class _Reopener:
    """Sends a broken stream's request again (the blocking or the async stub). needs_seed: an unseeded sampled
    request resumed by default: only with the seed the server told (a new draw would change the rest)."""

    def __init__(self, stub, request: pb.GenerateRequest, timeout: float | None, metadata, needs_seed: bool) -> None:
        self.stub, self.request, self.timeout, self.metadata, self.needs_seed = stub, request, timeout, metadata, needs_seed

    def can_resume(self, seed: int | None) -> bool:
        return seed is not None or not self.needs_seed

    def __call__(self, received: list[int], seed: int | None, had_prompt_logprobs: bool):
        return self.stub.Generate(_reopen_request(self.request, received, seed, had_prompt_logprobs),
                                  timeout=self.timeout, metadata=self.metadata)


def reopener(stub, request: pb.GenerateRequest, timeout: float | None, metadata, sampling: dict,
             resume: bool | None) -> _Reopener | None:
    """How a stream resumes: None with resume=False; resume=None resumes greedy and seeded requests, and sampled
    ones with the seed the server told in Started (every server that tells it); resume=True resumes all."""
    if resume is False:
        return None
    exact = sampling.get("temperature") == 0 or sampling.get("seed") is not None
    return _Reopener(stub, request, timeout, metadata, needs_seed=resume is None and not exact)
