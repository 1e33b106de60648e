# clipdist on a CUDA cluster: the official PyTorch runtime image (its torch inside pyproject.toml's range),
# clipdist installed into a venv that sees the base's torch, run as a non-root user.
#   docker build -t clipdist .
#   docker run --gpus all --rm -v $PWD/runs:/app/runs clipdist loss=disco world=1gpu
# Any base with Python >= 3.10 works; one without torch names the torch to install:
#   podman build --build-arg BASE=localhost/debian-python --build-arg TORCH="torch==2.14.1 torchvision==0.29.1" .
# (tests/integration/test_container.py builds it that way on a Debian base made with mmdebstrap.)
ARG BASE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime
FROM ${BASE}

# Pip requirement specifiers for torch and torchvision when BASE has none; empty: use the base's.
ARG TORCH=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/clipdist \
    PATH=/opt/clipdist/bin:$PATH \
    WANDB_DIR=/app/runs \
    XDG_CACHE_HOME=/app/.cache

# A venv on top of the base's Python: the base's torch stays visible (--system-site-packages), and pip never
# touches the system's packages (Debian's Python refuses that, PEP 668). TORCH carries its own pins.
# hadolint ignore=DL3013
RUN python3 -m venv --system-site-packages "$VIRTUAL_ENV" \
    && if [ -n "$TORCH" ]; then pip install $TORCH; fi \
    && python -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"

RUN useradd --create-home --uid 1000 clipdist \
    && mkdir -p /app/runs /app/.cache \
    && chown -R clipdist:clipdist /app
WORKDIR /app

# The dependencies first, in a layer that only pyproject.toml invalidates (installed through an empty stand-in of
# the package, then the stand-in removed): a code change re-runs the small layer below, not the downloads. pip
# checks the base's torch against pyproject.toml's range: a base outside it stops the build here instead of
# downloading another.
COPY --chown=clipdist:clipdist pyproject.toml README.md ./
RUN torch_now=$(python -c "import torch; print(torch.__version__.split('+')[0])") \
    && mkdir clipdist && touch clipdist/__init__.py \
    && pip install "torch==$torch_now" . \
    && pip uninstall --yes clipdist && rm -rf clipdist build ./*.egg-info
COPY --chown=clipdist:clipdist clipdist ./clipdist
COPY --chown=clipdist:clipdist train.py ./
RUN pip install --no-deps -e . \
    && python -m clipdist --help > /dev/null

USER 1000:1000
ENTRYPOINT ["python", "train.py"]
