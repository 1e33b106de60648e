# CUDA runtime image with PyTorch; clipdist installed with the README's command.
#   docker build -t clipdist .
#   docker run --gpus all --rm -v $PWD/runs:/app/runs clipdist loss=disco world=1gpu
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    WANDB_DIR=/app/runs \
    XDG_CACHE_HOME=/app/.cache

RUN useradd --create-home --uid 1000 clipdist \
    && mkdir -p /app/runs /app/.cache \
    && chown -R clipdist:clipdist /app
WORKDIR /app

# Dependencies first (cached while only the code changes), then the package itself.
COPY --chown=clipdist:clipdist pyproject.toml README.md ./
COPY --chown=clipdist:clipdist clipdist ./clipdist
COPY --chown=clipdist:clipdist train.py ./
RUN pip install -e .

USER 1000:1000
ENTRYPOINT ["python", "train.py"]
