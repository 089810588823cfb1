# Sourced by run_train.sh, run_tests.sh and bench/run.sh: makes ./.venv with the pinned
# packages once. torch is pinned to 2.13.0 first, so nothing pulls a CUDA build; the
# stamp records which pyproject.toml and extras the environment was built from.
VENV=${VENV:-"$PWD/.venv"}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
stamp="$VENV/.titan_recover-installed"
want=$(cat pyproject.toml; echo "extras: $EXTRAS")
if [ ! -f "$stamp" ] || [ "$want" != "$(cat "$stamp")" ]; then
    echo "[bootstrap] setting up $VENV (first run takes a few minutes; log: $VENV/install.log)" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    if ! { "$VENV/bin/python" -m pip install --upgrade pip \
        && "$VENV/bin/python" -m pip install "torch==2.13.0" \
        && "$VENV/bin/python" -m pip install -e ".[$EXTRAS]"; } > "$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        echo "[bootstrap] installing packages failed; full log: $VENV/install.log" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
export PYTHONUNBUFFERED=1
