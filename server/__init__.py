"""FastAPI layer of MTPLX: OpenAI schemas, routes, SSE. Never imports mlx."""
