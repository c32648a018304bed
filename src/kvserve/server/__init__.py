"""The OpenAI-compatible server: FastAPI app, async engine loop, Prometheus metrics."""
