#!/usr/bin/env bash
# Create the peers' virtual environments under benchmarks/peers/.venvs/ (skipped when present):
#   pfl/   torch 2.13.0 + pfl[pytorch] 0.6.0   (pfl-research)
#   flwr/  torch 2.13.0 + flwr[simulation]     (Flower's simulation engine, on ray)
# torch is pinned by constraints.txt so that no dependency can swap it for a CUDA build.
# A venv is only kept when its import check passes (a ".ok" marker); a failed install is
# logged to .venvs/<name>.log and the benchmark runs without that column.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PEERS_PYTHON:-python3}"           # pfl 0.6.0 needs Python 3.10-3.12, flwr >= 3.11
PFL_VERSION="${PFL_VERSION:-0.6.0}"
# flwr 1.42.0 (the newest) needs certifi>=2026.10.19, which the package index lacks: 1.41.0
# is the newest whose dependencies resolve here.
FLWR_VERSION="${FLWR_VERSION:-1.41.0}"
mkdir -p "$HERE/.venvs"

make_venv() {  # name, import check, packages...
    local name="$1" check="$2"; shift 2
    local dir="$HERE/.venvs/$name" log="$HERE/.venvs/$name.log"
    if [[ -f "$dir/.ok" ]]; then return 0; fi
    echo "setting up $dir (log: $log); this takes minutes" >&2
    rm -rf "$dir"
    {
        "$PY" -m venv "$dir" &&
        "$dir/bin/pip" install --upgrade -q pip &&
        "$dir/bin/pip" install -c "$HERE/constraints.txt" "torch==2.13.0" "$@" &&
        "$dir/bin/python" -c "$check"
    } >"$log" 2>&1
    if [[ $? -eq 0 ]]; then
        touch "$dir/.ok"
        echo "  $name ready" >&2
    else
        echo "  $name FAILED: see $log (last lines below); its column is left out" >&2
        tail -n 5 "$log" >&2
        return 1
    fi
}

status=0
make_venv pfl "import torch, pfl, pfl.model.pytorch; assert torch.__version__.startswith('2.13.0')" \
    "pfl[pytorch]==$PFL_VERSION" || status=1
make_venv flwr "import torch, flwr, ray, flwr.simulation; assert torch.__version__.startswith('2.13.0')" \
    "flwr[simulation]==$FLWR_VERSION" || status=1
exit $status
