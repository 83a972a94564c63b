"""api: the HTTP layer (FastAPI: REST, OpenAI-compatible chat, admin, /metrics).

Arrives with the REST API issue. It calls `ragcache.RagCache` and holds no model or store logic.
"""
