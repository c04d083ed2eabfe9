# Production image: NGC tritonserver (Python backend included) + paddlepaddle-gpu + this package, serving
# model_repository/ through `ernie-serve` (which finds the image's own tritonserver on PATH). The GPU path it runs:
# the kernels backend on Paddle GPU tensors (triton kernels through paddle.enable_compat). Dockerfile.torch is the
# same image with torch as the tensor framework. Which image runs which path, and what has run on a GPU:
# docs/gpu-images.md.
#
# NOT BUILT here (no Docker daemon, no GPU, no network beyond PyPI). What CI checks instead
# (tests/packaging/test_image_recipe.py): scripts/check_image_recipe.py reads this file's pip install steps and
# resolves them with pip --dry-run on the image's Python, with a stand-in paddlepaddle-gpu, failing if any other
# `paddle` would be installed or a pinned version has no wheel for that Python; and hadolint lints this file.
#
# The base: tritonserver 24.10 = Triton 2.51, the version the tests run (nvidia-pytriton 0.7.0's binary), on Ubuntu
# 22.04, whose Python is 3.10 (3.10.12 in NVIDIA's Triton release compatibility matrix). The package declares
# requires-python >= 3.10 and CI checks the code against that floor (tests/packaging/test_python_floor.py).
# CUDA 12.6 in the image: Paddle's cu126 index.
#
#   docker build -t ernie-triton .
#   docker run --gpus all --shm-size 2g -p 8000-8002:8000-8002 -v /ckpt:/ckpt ernie-triton \
#       --model /ckpt/ERNIE-4.5-21B-A3B-Paddle --max-model-len 8192 --reasoning-parser ernie-x1
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}

ARG PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu126/
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# Paddle >= 3.3: ernie_kernels uses paddle.enable_compat, public from 3.3. Its GPU build is on Paddle's index only.
RUN python3 -m pip install "pip==26.3" \
 && python3 -m pip install "paddlepaddle-gpu>=3.3" -i ${PADDLE_INDEX}

WORKDIR /opt/ernie
COPY pyproject.toml README.md* ./
COPY backend backend
COPY kernels kernels
COPY client client
COPY model_repository model_repository
COPY scripts scripts
# The image's python backend runs the system python3, so install into it (no venv). The `gpu` extra names the
# paddlepaddle-gpu installed above (already satisfied: nothing is replaced); no extra pulls the CPU `paddlepaddle`.
# The nvidia-pytriton extra is not needed here: the image has tritonserver at /opt/tritonserver/bin (on PATH).
RUN python3 -m pip install -e ".[gpu,kernels]"
# No GPU is visible during `docker build`, so this check may only warn; it must not hide a failed install.
RUN python3 -c "import paddle; assert paddle.is_compiled_with_cuda(), 'a CPU build of paddle is installed'" \
 && (python3 -c "import paddle; paddle.utils.run_check()" || echo "paddle run_check needs a GPU at run time")

# Where locally built demo models go when no --model is given.
ENV ERNIE_MODELS_DIR=/opt/ernie/.cache/models
EXPOSE 8000 8001 8002 9000
ENTRYPOINT ["ernie-serve", "--host", "0.0.0.0"]
CMD []
