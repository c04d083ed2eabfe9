# Production image: NGC tritonserver (Python backend included) + paddlepaddle-gpu + this package,
# serving model_repository/ through `ernie-serve` (which finds the image's own tritonserver on PATH).
#
# NOT BUILT OR TESTED on the development machine (no Docker, no GPU, no network there). What is tested
# there is the same repository and launcher on the tritonserver binary of the nvidia-pytriton wheel.
# Pick the paddlepaddle-gpu wheel matching the image's CUDA (24.10 ships CUDA 12.6: the cu126 index).
#
#   docker build -t ernie-triton .
#   docker run --gpus all --shm-size 2g -p 8000-8002:8000-8002 -v /ckpt:/ckpt ernie-triton \
#       --model /ckpt/ERNIE-4.5-21B-A3B-Paddle --max-model-len 8192 --reasoning-parser ernie-x1
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}

ARG PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu126/
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN python3 -m pip install --upgrade pip \
 && python3 -m pip install "paddlepaddle-gpu>=3.2" -i ${PADDLE_INDEX}

WORKDIR /opt/ernie
COPY pyproject.toml README.md* ./
COPY backend backend
COPY kernels kernels
COPY client client
COPY model_repository model_repository
COPY scripts scripts
# The image's python backend runs the system python3, so install into it (no venv). The nvidia-pytriton
# extra is not needed here: the image has tritonserver at /opt/tritonserver/bin (on PATH).
RUN python3 -m pip install -e ".[kernels]"
# No GPU is visible during `docker build`, so this check may only warn; it must not hide a failed install.
RUN python3 -c "import paddle; paddle.utils.run_check()" || echo "paddle run_check needs a GPU at run time"

# Where locally built demo models go when no --model is given.
ENV ERNIE_MODELS_DIR=/opt/ernie/.cache/models
EXPOSE 8000 8001 8002 9000
ENTRYPOINT ["ernie-serve", "--host", "0.0.0.0"]
CMD []
