# Sourced by run_train.sh and run_tests.sh: makes ./.venv with the pinned packages once.
# torch is pinned to 2.13.0 first, so nothing pulls a CUDA build; the stamp records
# which pyproject.toml the environment was built from.
VENV=${VENV:-"$PWD/.venv"}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.titan_recover-installed"
if [ ! -f "$stamp" ] || ! cmp -s pyproject.toml "$stamp"; then
    echo "[bootstrap] setting up $VENV (first run takes a few minutes)" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" >&2
    "$VENV/bin/python" -m pip install --quiet -e ".[test]" >&2
    cp pyproject.toml "$stamp"
fi
export PYTHONUNBUFFERED=1
