#!/usr/bin/env bash
# On the lent GPU machine, from the repo root with `.whl` carried (bench/gpu_bundle.sh makes it): install the wheels, run bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --out=$OUT "$@"
