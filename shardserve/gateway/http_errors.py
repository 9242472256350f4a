"""The gateway's errors: a gRPC status -> its HTTP status and OpenAI error body (a JSON response, or one server-sent
event once a stream has begun)."""

from __future__ import annotations

import re

import grpc
from fastapi.responses import JSONResponse

from shardserve.gateway.openai_format import error_body, sse

# gRPC status -> (HTTP status, OpenAI error type, code)
HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "unavailable"),
    # the call was cancelled under a request the gateway still answers: the server or the gateway is stopping
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
}
_LEADING_FIELD = re.compile(r"(\w+) must be ")
# cluster/admission.py's refusals of a prompt that does not fit: "prompt (N tokens) + max_tokens ... exceeds
# max_model_len (L)", "... leaves no room to generate within max_model_len", "... needs K KV blocks ... the cache"
_TOO_LONG = re.compile(r"prompt \(\d+ tokens\) .*(max_model_len|KV blocks)")
_TOO_LARGE = re.compile(r"(Received|Sent) message larger than max")  # gRPC's words for a message over its limit


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    @classmethod
    def of_rpc(cls, error: grpc.RpcError, prompt_field: str = "prompt") -> "GatewayError":
        """prompt_field: what the request called its prompt ("messages" for a chat), named by a too-long refusal."""
        status, type_, code = HTTP_OF.get(error.code(), (500, "server_error", None))
        message = error.details() or error.code().name
        param = None
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # "temperature must be ...": the field it names
            param = (match := _LEADING_FIELD.match(message)) and match.group(1)
            if _TOO_LONG.match(message):  # OpenAI's code for it: clients trim the prompt and retry
                param, code = prompt_field, "context_length_exceeded"
            elif message.startswith(("prompt", "chat")):  # "prompt token ids must be ...", "chat roles must be ..."
                param = prompt_field
        elif error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE.search(message):
            # gRPC's own message limit, not the server's load: retrying cannot help
            status, type_, code = 413, "invalid_request_error", "request_too_large"
        return cls(status, message, type_, param, code or error.code().name.lower())

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, self.param, self.code), status_code=self.status)

    def event(self) -> bytes:
        return sse(error_body(str(self), self.type, self.param, self.code))
