FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY web web
COPY jobs jobs
COPY workers workers
COPY mlxq mlxq
RUN pip install --no-cache-dir '.[cpu]'
EXPOSE 8000
CMD ["mlxq", "serve", "--host", "0.0.0.0", "--port", "8000"]
