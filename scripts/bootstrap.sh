# Sourced by run_train.sh, run_tests.sh and bench/run.sh: makes the environment of the TorchTitan line
# $TORCHTITAN names (0.2.2, the default: ./.venv; 0.3.0: ./.venv-0.3.0) with the pinned packages, once.
# torch is pinned first, so nothing pulls another build; the stamp records which pyproject.toml, extras
# and sources the environment was built from.
#
# Where torch is installed already (a CUDA container, a cluster's image), TORCH_FROM=env reuses it: the
# environment then sees the torch of $PYTHON (and every package beside it) and installs only the rest,
# without the torch and triton pins. WHEELS=DIR installs from that folder alone, with no network
# (pip --no-index --find-links DIR): the packages of pyproject.toml and its extras, as wheels.
#   TORCH_FROM=env PYTHON=/usr/bin/python3 WHEELS=/data/wheels ./run_train.sh
TORCHTITAN=${TORCHTITAN:-0.2.2}
case "$TORCHTITAN" in
    0.2.2) torch_pin=2.13.0; line_extra=torchtitan022; default_venv="$PWD/.venv" ;;
    0.3.0) torch_pin=2.14.1; line_extra=torchtitan030; default_venv="$PWD/.venv-0.3.0" ;;
    *) echo "error: TORCHTITAN=$TORCHTITAN: titan_recover runs on TorchTitan 0.2.2 (the default) or 0.3.0" >&2; exit 2 ;;
esac
export TORCHTITAN
VENV=${VENV:-"$default_venv"}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test}  # none: only the line's packages (no test tools)
extras=$line_extra
[ "$EXTRAS" = none ] || extras="$extras,$EXTRAS"
TORCH_FROM=${TORCH_FROM:-pip}
WHEELS=${WHEELS:-}
case "$TORCH_FROM" in
    pip|env) ;;
    *) echo "error: TORCH_FROM=$TORCH_FROM: pip (the pinned torch, the default) or env (the torch \$PYTHON has)" >&2; exit 2 ;;
esac
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
    echo "error: WHEELS=$WHEELS is not a folder: name the folder of wheels to install from" >&2; exit 2
fi
stamp="$VENV/.titan_recover-installed"
sources=""  # the default (the pinned torch, from the package index) keeps the stamp it always had
[ "$TORCH_FROM" = pip ] && [ -z "$WHEELS" ] || sources="; torch from: $TORCH_FROM; wheels: ${WHEELS:-the package index}"
want=$(cat pyproject.toml; echo "extras: $line_extra,$EXTRAS$sources")
if [ ! -f "$stamp" ] || [ "$want" != "$(cat "$stamp")" ]; then
    echo "[bootstrap] setting up $VENV for TorchTitan $TORCHTITAN (first run takes a few minutes; log: $VENV/install.log)" >&2
    mkdir -p "$VENV"
    : > "$VENV/install.log"
    pip_from=()
    [ -z "$WHEELS" ] || pip_from=(--no-index --find-links "$WHEELS")
    if [ "$TORCH_FROM" = env ]; then
        torch_site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>> "$VENV/install.log") || {
            echo "error: TORCH_FROM=env: $PYTHON cannot import torch (see $VENV/install.log): name the python whose torch to reuse with PYTHON=" >&2
            exit 2
        }
    fi
    if ! {
        { [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"; } \
        && if [ "$TORCH_FROM" = env ]; then
            # the environment's torch, after this environment's own packages: a .pth line, which works for a
            # system python and for another virtualenv alike (--system-site-packages sees only the former)
            "$VENV/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/titan_recover_torch.pth", "w").write(sys.argv[1] + "\n")' "$torch_site" \
            && "$VENV/bin/python" scripts/requirements.py "$extras" --without torch triton > "$VENV/requirements.txt" \
            && "$VENV/bin/python" -m pip install "${pip_from[@]}" -r "$VENV/requirements.txt" \
            && "$VENV/bin/python" -m pip install "${pip_from[@]}" --no-deps --no-build-isolation -e .
        else
            { [ -n "$WHEELS" ] || "$VENV/bin/python" -m pip install --upgrade pip; } \
            && "$VENV/bin/python" -m pip install "${pip_from[@]}" "torch==$torch_pin" \
            && "$VENV/bin/python" -m pip install "${pip_from[@]}" -e ".[$extras]"
        fi
    } >> "$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        echo "[bootstrap] installing packages failed; full log: $VENV/install.log" >&2
        exit 1
    fi
    if [ "$TORCH_FROM" = env ]; then
        echo "[bootstrap] reusing torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__, "from", torch.__file__)')" >&2
    fi
    echo "$want" > "$stamp"
fi
export PYTHONUNBUFFERED=1
