"""A small SSE reader for tests: (event, data) pairs as they arrive."""
from __future__ import annotations

import json


def events(response):
    event, data = None, []
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            text = "\n".join(data)
            yield event, (text if text == "[DONE]" else json.loads(text))
            event, data = None, []
