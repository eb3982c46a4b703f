#!/usr/bin/env bash
# The gateway's longest /health answer while it handles a maximal chat turn (tests/gateway/test_maximal_request.py),
# with two busy loops beside it on a 2-core host, as CI's load; one line per run.
#   bash bench/maximal_request_health.sh LABEL RUNS     (results: bench/results/maximal_request_health.md)
set -euo pipefail
cd "$(dirname "$0")/.."
label=${1:-run} runs=${2:-5}
hogs=()
for _ in 1 2; do python3 -c "while 1: pass" & hogs+=($!); done
trap 'kill "${hogs[@]}"' EXIT
for _ in $(seq 1 "$runs"); do
  .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/gateway/test_maximal_request.py 2>&1 \
    | grep -oE "max [0-9]+ ms" | sed "s/^/$label /"
done
