"""Steps an Engine to completion for tests, aborting chosen requests once they have produced enough tokens."""

from __future__ import annotations


def drive(engine, abort_after: dict[str, int] | None = None, max_steps: int = 2000) -> None:
    """Steps until nothing is left; a request in abort_after is aborted once it has that many tokens.
    Fails if the engine is still busy after max_steps (a hang would otherwise look like a slow test)."""
    abort_after = dict(abort_after or {})
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        for req_id, n in list(abort_after.items()):
            out = engine.get_output(req_id)
            if out is not None and len(out.outputs[0].token_ids) >= n:
                engine.abort(req_id)
                del abort_after[req_id]
        engine.step()
    raise AssertionError(f"engine did not finish in {max_steps} steps")
