"""The OpenAI-compatible HTTP gateway: routes (app.py), request bodies (openai_schema.py), the generation streams
(generation.py), response bodies (openai_format.py), several processes on one port (processes.py), metrics, what a
request and a connection may cost (request_limits.py, connections.py)."""
