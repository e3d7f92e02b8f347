"""An OpenAI-compatible HTTP server on the multi-problem engine (the `serve` extra: FastAPI, uvicorn,
sse-starlette). Requests become slots of one Rescue engine run by one thread (engine.py); the app (app.py)
talks to it through queues."""
