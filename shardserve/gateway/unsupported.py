"""UnsupportedField: a request field the gateway answers with 400, naming it as OpenAI's `param`."""

from __future__ import annotations


class UnsupportedField(ValueError):
    """An OpenAI field whose value this server cannot honour; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
