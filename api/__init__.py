"""api: the HTTP layer (FastAPI): REST retrieve-and-generate, OpenAI-compatible chat, documents,
jobs, cache admin, health, /metrics and the dashboard. It calls `ragcache` and holds no model or
store logic (DESIGN.md layering: api → ragcache)."""
