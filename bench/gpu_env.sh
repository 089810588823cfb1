# Sourced by the GPU scripts (bench/gpu_check.sh, bench/nccl.sh, bench/moe.sh). On a machine whose python3 has
# torch with a GPU and TorchTitan's wheels in .whl/ (docs/gpus.md: a bare, offline GPU machine), installs the
# wheels beside that torch and asks for NCCL in every communicator (NCCL=(...) flags); elsewhere it uses the
# checkout's .venv (gloo on a CPU). Sets PY, NCCL and ON_GPU.
if [ -d .whl ] && python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD; PY=python3; ON_GPU=1
    NCCL=(--recover.nccl_rank_per_host --recover.replicate_backend nccl)
else
    PY=${PY:-.venv/bin/python}; ON_GPU=0; NCCL=()
fi
export PYTHONUNBUFFERED=1
