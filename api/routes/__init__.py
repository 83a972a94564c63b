"""One module per resource: rag, openai, documents, jobs, cache, health, dashboard."""
