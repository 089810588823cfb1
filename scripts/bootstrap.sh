# Sourced by run_train.sh, run_tests.sh and bench/run.sh: makes the environment of the TorchTitan line
# $TORCHTITAN names (0.2.2, the default: ./.venv; 0.3.0: ./.venv-0.3.0) with the pinned packages, once.
# torch is pinned first, so nothing pulls another build; the stamp records which pyproject.toml, extras
# and sources the environment was built from. EXTRAS are the extras beside the line's (test by default;
# run_train.sh: none): an environment that has them, or more, is used as it is, and one that lacks some
# gets only those (./run_tests.sh after ./run_train.sh adds the test tools and nothing else).
#
# Where torch is installed already (a CUDA container, a cluster's image), TORCH_FROM=env reuses it: the
# environment then sees the torch of $PYTHON (and every package beside it) and installs only the rest,
# without the torch and triton pins, keeping the numpy it finds. WHEELS=DIR installs from that folder alone,
# with no network (pip --no-index --find-links DIR): the packages of pyproject.toml and its extras, as wheels.
#   TORCH_FROM=env PYTHON=/usr/bin/python3 WHEELS=/data/wheels ./run_train.sh
# VENV naming an environment this script did not make, whose python has torch (a conda environment, a
# container's, without titan_recover's stamp), is treated so for its own python: the rest goes into it,
# and its torch, triton and numpy are never installed over (pip is held to their versions).
#   VENV=$CONDA_PREFIX ./run_train.sh
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
wanted=$line_extra
for extra in ${EXTRAS//,/ }; do [ "$extra" = none ] || wanted="$wanted,$extra"; done
TORCH_FROM=${TORCH_FROM:-pip}
WHEELS=${WHEELS:-}
case "$TORCH_FROM" in
    pip|env) ;;
    *) echo "error: TORCH_FROM=$TORCH_FROM: pip (the pinned torch, the default) or env (the torch \$PYTHON has)" >&2; exit 2 ;;
esac
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
    echo "error: WHEELS=$WHEELS is not a folder: name the folder of wheels to install from" >&2; exit 2
fi
if [ ! -e "$VENV/bin/python" ] && [ -e "$VENV/bin/python3" ]; then  # e.g. VENV=/usr: never made into a virtualenv
    echo "error: VENV=$VENV has bin/python3 but no bin/python: name an environment with bin/python (a conda environment, a virtualenv), or reuse this one's torch from ./.venv with TORCH_FROM=env PYTHON=$VENV/bin/python3" >&2
    exit 2
fi
# One bootstrap at a time per environment: the launchers of a multi-node job share it (one folder on a shared
# file system) and start together; two pip installs into one environment break each other. The others wait,
# then find it made. The lock is released before the command runs (fd 9 closed below).
lock_wait_s=1800
if command -v flock > /dev/null && mkdir -p "$VENV" 2> /dev/null && [ -w "$VENV" ]; then
    exec 9>> "$VENV/.titan_recover-lock"
    if ! flock -n 9; then
        echo "[bootstrap] another bootstrap is setting up $VENV: waiting for it (at most ${lock_wait_s}s)" >&2
        flock -w "$lock_wait_s" 9 || {
            echo "error: another bootstrap of $VENV held it for ${lock_wait_s}s: if that one is stuck, stop it (fuser -v $VENV/.titan_recover-lock names it)" >&2
            exit 1
        }
    fi
fi
stamp="$VENV/.titan_recover-installed"
made="$VENV/.titan_recover-made"  # this script made the environment (python -m venv): it is never adopted
own_torch="torch from: this environment's own"  # the stamp of an adopted environment says so
adopted=""
if { [ -f "$stamp" ] && grep -q "; $own_torch" "$stamp"; } || { [ ! -f "$stamp" ] && [ ! -f "$made" ] \
        && [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import torch' 2> /dev/null; }; then
    adopted=1
    TORCH_FROM=env
fi
sources=""  # the default (the pinned torch, from the package index) keeps the stamp it always had
if [ -n "$adopted" ]; then
    sources="; $own_torch; wheels: ${WHEELS:-the package index}"
elif [ "$TORCH_FROM" != pip ] || [ -n "$WHEELS" ]; then
    sources="; torch from: $TORCH_FROM; wheels: ${WHEELS:-the package index}"
fi
stamp_for() { cat pyproject.toml; echo "extras: $1$sources"; }  # the stamp of an environment with extras $1
had=""  # the extras of an environment made from this pyproject.toml and these sources
if [ -f "$stamp" ]; then
    had=$(sed -n 's/^extras: \([^;]*\).*$/\1/p' "$stamp" | tail -n 1)
    [ "$(cat "$stamp")" = "$(stamp_for "$had")" ] || had=""
fi
missing=""
for extra in ${wanted//,/ }; do
    case ",$had," in *",$extra,"*) ;; *) missing="$missing,$extra" ;; esac
done
if [ -n "$missing" ]; then
    fresh=""  # empty: the environment is up to date but for the extras $missing
    if [ -z "$had" ]; then
        fresh=1
        extras=$wanted
        echo "[bootstrap] setting up $VENV for TorchTitan $TORCHTITAN (first run takes a few minutes; log: $VENV/install.log)" >&2
        mkdir -p "$VENV"
        : > "$VENV/install.log"
    else
        extras=$(echo ",$had," | sed 's/,none,/,/g; s/^,//; s/,$//')$missing
        echo "[bootstrap] adding the extras ${missing#,} to $VENV (log: $VENV/install.log)" >&2
    fi
    if [ -n "$adopted" ] && [ -n "$fresh" ]; then
        echo "[bootstrap] $VENV has a torch of its own and no titan_recover stamp: installing only what is missing beside it, never torch, triton or numpy (as TORCH_FROM=env does)" >&2
    fi
    pip_from=()
    [ -z "$WHEELS" ] || pip_from=(--no-index --find-links "$WHEELS")
    if [ "$TORCH_FROM" = env ] && [ -n "$fresh" ] && [ -z "$adopted" ]; then
        torch_site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>> "$VENV/install.log") || {
            echo "error: TORCH_FROM=env: $PYTHON cannot import torch (see $VENV/install.log): name the python whose torch to reuse with PYTHON=" >&2
            exit 2
        }
    fi
    if ! {
        { [ -z "$fresh" ] || [ -x "$VENV/bin/python" ] || { "$PYTHON" -m venv "$VENV" && : > "$made"; }; } \
        && if [ "$TORCH_FROM" = env ]; then
            # the environment's torch, after this environment's own packages: a .pth line, which works for a
            # system python and for another virtualenv alike (--system-site-packages sees only the former)
            { [ -z "$fresh" ] || [ -n "$adopted" ] \
                || "$VENV/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/titan_recover_torch.pth", "w").write(sys.argv[1] + "\n")' "$torch_site"; } \
            && "$VENV/bin/python" -c 'from importlib import metadata as m
for name in ("torch", "triton", "numpy"):  # pip is held to the versions installed
    try: print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError: pass' > "$VENV/constraints.txt" \
            && "$VENV/bin/python" scripts/requirements.py "$extras" --without torch triton --unpin numpy > "$VENV/requirements.txt" \
            && "$VENV/bin/python" -m pip install "${pip_from[@]}" -c "$VENV/constraints.txt" -r "$VENV/requirements.txt" \
            && { [ -z "$fresh" ] || "$VENV/bin/python" -m pip install "${pip_from[@]}" --no-deps --no-build-isolation -e .; }
        else
            { [ -z "$fresh" ] || [ -n "$WHEELS" ] || "$VENV/bin/python" -m pip install --upgrade pip; } \
            && { [ -z "$fresh" ] || "$VENV/bin/python" -m pip install "${pip_from[@]}" "torch==$torch_pin"; } \
            && "$VENV/bin/python" -m pip install "${pip_from[@]}" -e ".[$extras]"
        fi
    } >> "$VENV/install.log" 2>&1; then
        tail -n 30 "$VENV/install.log" >&2
        echo "[bootstrap] installing packages failed; full log: $VENV/install.log" >&2
        exit 1
    fi
    if [ "$TORCH_FROM" = env ] && [ -n "$fresh" ]; then
        echo "[bootstrap] reusing torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__, "from", torch.__file__)')" >&2
    fi
    stamp_for "$extras" > "$stamp"
fi
exec 9>&-  # the bootstrap's lock, released (closed where it was never opened: a no-op)
export PYTHONUNBUFFERED=1
