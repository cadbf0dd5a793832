FROM python:3.11-slim
# g++: MLX builds its fused CPU kernels with it at run time (workers/backends/cpu_math.py: Whisper's
# softmax and GELU about 5x faster on a CPU); without it they run unfused and mlxq uses MLX's own ops.
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread g++ \
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
