# Sourced by run_train.sh, run_tests.sh and bench/run.sh: makes the environment of the TorchTitan line
# $TORCHTITAN names (0.2.2, the default: ./.venv; 0.3.0: ./.venv-0.3.0) with the pinned packages, once.
# torch is pinned first, so nothing pulls another build; the stamp records which pyproject.toml and
# extras the environment was built from.
TORCHTITAN=${TORCHTITAN:-0.2.2}
case "$TORCHTITAN" in
    0.2.2) torch_pin=2.13.0; line_extra=torchtitan022; default_venv="$PWD/.venv" ;;
    0.3.0) torch_pin=2.14.1; line_extra=torchtitan030; default_venv="$PWD/.venv-0.3.0" ;;
    *) echo "error: TORCHTITAN=$TORCHTITAN: titan_recover runs on TorchTitan 0.2.2 (the default) or 0.3.0" >&2; exit 2 ;;
esac
export TORCHTITAN
VENV=${VENV:-"$default_venv"}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}
stamp="$VENV/.titan_recover-installed"
want=$(cat pyproject.toml; echo "extras: $line_extra,$EXTRAS")
if [ ! -f "$stamp" ] || [ "$want" != "$(cat "$stamp")" ]; then
    echo "[bootstrap] setting up $VENV for TorchTitan $TORCHTITAN (first run takes a few minutes; log: $VENV/install.log)" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    if ! { "$VENV/bin/python" -m pip install --upgrade pip \
        && "$VENV/bin/python" -m pip install "torch==$torch_pin" \
        && "$VENV/bin/python" -m pip install -e ".[$line_extra,$EXTRAS]"; } > "$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        echo "[bootstrap] installing packages failed; full log: $VENV/install.log" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
export PYTHONUNBUFFERED=1
