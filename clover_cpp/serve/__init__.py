"""``clover-cpp serve``: an OpenAI-compatible HTTP server on the native engine (FastAPI + uvicorn + SSE).

Requests queue on the engine's slots (``worker.EngineWorker``); a client that disconnects cancels its generation,
queued or running. Every error is an OpenAI error body; nothing a client sends stops the server. docs/serve.md.

- ``security``: limits, the Host check, API keys and the body size (middleware);
- ``schema``: the OpenAI request and response shapes;
- ``prepare``: a request's prompt ids, stops and generation parameters;
- ``worker``: the queue on the engine's slots;
- ``service``: the model and queue behind the routes, preparation off the event loop, a whole answer's course;
- ``streaming``: streamed answers;
- ``routes``: the endpoints;
- ``connections``: the cap on open connections, the --timeout deadline, throttled per-connection log lines;
- ``startup``: ``run_serve``.
"""
