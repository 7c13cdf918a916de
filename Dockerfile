# syntax=docker/dockerfile:1
# megatron-gndpo for GPU clusters: the NGC PyTorch image plus this package with its `vllm` and
# `modelopt` extras. docs/DEPLOY.md walks through build, conversion, Slurm submission and export.
#
# Base image: NGC PyTorch 26.05 (Ubuntu 24.04, Python 3.12, CUDA 13.2, NCCL 2.30, PyTorch
# 2.12.0a0+nv, with Transformer Engine and apex compiled against that torch; apex is not on PyPI,
# so this is where it comes from). Its torch is a pre-release version, which pip accepts for
# setup.py's `torch>=2.6,<=2.14.1` because it is already installed. With a base tag whose torch is
# outside that range, the package install below fails with a resolver error about torch. Choose
# a tag in range (each tag's release notes give its PyTorch), or test the new torch and widen the
# range in setup.py. CUDA 13 needs NVIDIA driver R580 or newer on the nodes; the tag's release
# notes give the forward-compatibility options for older data-center drivers.
#
# Build (on a machine with Docker; vLLM compiles from source for sm_90, which takes 30-60 min):
#   docker build -t megatron-gndpo:0.1 .
#   docker build -t megatron-gndpo:0.1 --build-arg GNDPO_EXTRAS=modelopt .   # no vLLM, minutes
# Run with Docker:
#   docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v "$PWD:$PWD" -w "$PWD" megatron-gndpo:0.1 megatron-gndpo train -c examples/tiny_cpu.yaml
# Run with Slurm + enroot/pyxis: turn the image into a squashfs file on a shared filesystem, so
# every node reads that file and no node pulls from a registry:
#   enroot import -o megatron-gndpo.sqsh dockerd://megatron-gndpo:0.1      # from local dockerd
#   enroot import -o megatron-gndpo.sqsh docker://registry.example.com#team/megatron-gndpo:0.1
#   srun -N1 --container-image="$PWD/megatron-gndpo.sqsh" megatron-gndpo --version
#   IMAGE="$PWD/megatron-gndpo.sqsh" CONFIG=... sbatch scripts/slurm/gndpo.sbatch
# Under enroot/pyxis the container runs as the submitting user (USER below applies to docker run
# only), and values set by ENV here win over the host's unless srun passes --container-env=NAME
# (scripts/slurm/gndpo.sbatch does so for the NCCL variables it sets).

ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.05-py3
FROM ${BASE_IMAGE}

# Extras of setup.py to install, comma-separated. Without `vllm` the vLLM source build is skipped
# and rollouts use the built-in megatron-core generator (rollout.engine=builtin).
ARG GNDPO_EXTRAS=vllm,modelopt
# Pinned versions. vLLM is built from its git tag vVLLM_VERSION; its release should target the
# base image's torch minor version (0.25.0 has been built on NGC 26.05).
ARG VLLM_VERSION=0.25.0
ARG MODELOPT_VERSION=0.47.0
ARG MCORE_VERSION=0.19.2
# GPU architectures vLLM's kernels are compiled for (9.0 = H100/H200; add 10.0 for B200), and
# parallel compile jobs (each nvcc job can take several GB of memory).
ARG VLLM_CUDA_ARCHS=9.0
ARG VLLM_MAX_JOBS=16
ARG USER_UID=10001

# Megatron-core needs one hardware queue so that communication overlapped with compute keeps its
# launch order (tensor/sequence-parallel overlap); the NCCL values are safe defaults on any fabric,
# and scripts/slurm/gndpo.sbatch documents the site-specific ones. NVLS (NVLink SHARP) reserves
# GPU memory for every communicator, and megatron creates many (student and teacher TP/PP/DP/CP
# groups). TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a collective that times out kills the process
# instead of hanging the job. PYTHONNOUSERSITE: packages in a mounted ~/.local never shadow the
# image's.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_DEBUG=WARN \
    NCCL_NVLS_ENABLE=0 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 \
    PYTHONUNBUFFERED=1 \
    PYTHONNOUSERSITE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The base must be what this image is tested on: Python 3.12 and a CUDA build of torch.
RUN python -c "import sys, torch; \
print(f'python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}'); \
assert sys.version_info[:2] == (3, 12), 'pick an NGC PyTorch tag with Python 3.12'; \
assert torch.version.cuda, 'the base image has a CPU-only torch'"

# Hold the base's compiled torch stack at its versions for every later pip command (also those
# run inside the container), and record this image's own pins in the same file. This replaces
# NGC's blanket /etc/pip/constraint.txt, which pins every package and blocks ordinary upgrades.
COPY scripts/docker/pin_container_packages.py /tmp/pin_container_packages.py
RUN python /tmp/pin_container_packages.py /etc/megatron-gndpo/constraints.txt \
        "megatron-core==${MCORE_VERSION}" "nvidia-modelopt==${MODELOPT_VERSION}" \
    && rm /tmp/pin_container_packages.py
ENV PIP_CONSTRAINT=/etc/megatron-gndpo/constraints.txt

# vLLM from source against the image's torch (the slow layer; cached while VLLM_VERSION and the
# base stay the same).
COPY scripts/docker/install_vllm.sh /tmp/install_vllm.sh
RUN case ",${GNDPO_EXTRAS}," in \
        *,vllm,*) TORCH_CUDA_ARCH_LIST="${VLLM_CUDA_ARCHS}" MAX_JOBS="${VLLM_MAX_JOBS}" \
                      bash /tmp/install_vllm.sh "${VLLM_VERSION}" ;; \
    esac \
    && rm /tmp/install_vllm.sh

# Dependencies first, from the package metadata alone, so editing the source does not reinstall
# them. Same command as .ci/run (`pip install -e ".[test]"`), with the GPU extras.
WORKDIR /opt/megatron-gndpo
COPY setup.py pyproject.toml README.md ./
COPY megatron_gndpo/version.py megatron_gndpo/version.py
RUN pip install --no-cache-dir -e ".[${GNDPO_EXTRAS}]"

# Then the source. Editable, so a checkout bind-mounted over /opt/megatron-gndpo/megatron_gndpo
# runs without rebuilding the image.
COPY megatron_gndpo megatron_gndpo
RUN pip install --no-cache-dir --no-deps -e ".[${GNDPO_EXTRAS}]" \
    && megatron-gndpo --version

RUN groupadd --gid "${USER_UID}" gndpo \
    && useradd -l --create-home --uid "${USER_UID}" --gid gndpo --shell /bin/bash gndpo \
    && mkdir -p /workspace/gndpo \
    && chown gndpo:gndpo /workspace/gndpo
USER ${USER_UID}:${USER_UID}
WORKDIR /workspace/gndpo

# The NGC entrypoint stays (it reports driver/CUDA compatibility); the default command prints the
# CLI's help. Any other command runs as given: `docker run IMAGE megatron-gndpo train ...`.
CMD ["megatron-gndpo", "--help"]
