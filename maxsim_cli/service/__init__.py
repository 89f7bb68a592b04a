"""`maxsim serve`: exact search and rerank over HTTP, on a corpus opened once and kept resident.

- `schema`: the request models (JSON), the Arrow IPC stream, the JSON answer; checks each request.
- `batching`: concurrent requests gathered into one `search` / `rerank` call, answers split back.
- `app`: the FastAPI application (`create_app`) and the server (`serve`) under uvicorn.
- `metrics`: ``GET /metrics`` (Prometheus), across the processes of ``--workers N`` too.
- `openapi`: the OpenAPI schema (``/openapi.json``, ``/docs``) of every endpoint, body and error.

Built on the library's API only (`maxsim_cli.api`, `run`, `queries`, `errors` and the layers below);
FastAPI and uvicorn come with ``pip install 'maxsim[serve]'``. Importing this package imports neither.
"""
