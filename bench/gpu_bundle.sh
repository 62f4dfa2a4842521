#!/usr/bin/env bash
# Downloads into .whl/ (repo root, git-ignored) the wheels that the lent GPU machine lacks, for
# bench/gpu_check.py there (docs/gpu_check.md).
#
#   bash bench/gpu_bundle.sh             # download what is missing (idempotent), check the size
#   bash bench/gpu_bundle.sh --dry_run   # print what it would download; no network
#
# The GPU machine (Python 3.12, jax 0.11.2 with the CUDA 13 plugin, triton 3.6.0, torch, no
# network) gets the working tree plus `.whl` as a carried path, 64 MiB in all, and installs them
# with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`. --no-deps: every wheel
# it needs is named below, and the machine's own packages (its torch, jax, numpy, protobuf,
# tensorstore ...) stay as they are. Why each wheel is here: the comment beside it. Packages the
# machine already has (device/KINDS.md lists them) are not carried unless our pin matters.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
PY="${PYTHON:-python3}"
LIMIT_MIB=60 # the tree and the wheels travel together, 64 MiB at most: keep some room

WHEELS=(
  # jax 0.11.2 needs flax 0.12.12: 0.12.8 and 0.12.9 fail at import (no hijax.HiPrimitive).
  "flax==0.12.12"
  # jax-triton 0.4.x requires triton >= 3.7 and stubs out its CUDA backend under the machine's
  # triton 3.6.0; 0.3.1 requires triton >= 3.6 and jax >= 0.8.2.
  "jax-triton==0.3.1"
  # The machine's versions are unknown: carry our pins, proven with jax 0.11.2 (make test-jax011).
  "orbax-checkpoint==0.12.8"
  "optax==0.2.8"
  "chex==0.1.92"
  # requirements-base.txt packages the machine lacks, and what they need that it lacks too.
  "grain==0.2.18"
  "array-record==0.8.6" # grain (compiled: cp312 manylinux)
  "portpicker==1.6.0"   # grain
  "ml_collections==1.1.0"
  "math-verify==0.9.0"
  "latex2sympy2_extended==1.11.0"   # math-verify's exact pin
  "antlr4-python3-runtime==4.13.2"  # latex2sympy2_extended: >=4.9.3,<=4.13.2
  "gguf==0.19.0"
  "tensorboardX==2.6.5"
)

usage() {
  sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry_run | --dry-run) DRY_RUN=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      echo "gpu_bundle.sh: unknown argument $arg (use --dry_run or --help)" >&2
      exit 2
      ;;
  esac
done

# Wheel file names spell the project name with '_' for any run of '-', '_' or '.' and in any
# case (tensorboardx-2.6.5-..., ml_collections-1.1.0-...): compare names in that form.
norm() { echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g'; }

# Every manylinux tag a CPython 3.12 x86-64 wheel of these packages is published under
# (pip matches each tag exactly), plus `any` for the pure-Python py3-none-any wheels.
PIP_ARGS=(
  download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any
  -d "$DEST"
)

have() { # have NAME VERSION: a wheel of exactly that version is in .whl
  local n
  n="$(norm "$1")"
  [ -d "$DEST" ] && ls "$DEST" | tr '[:upper:]' '[:lower:]' | grep -q "^${n}-$2-.*\.whl$"
}

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_bundle.sh --dry_run: would download into $DEST (nothing is fetched now):"
  for spec in "${WHEELS[@]}"; do
    name="${spec%%==*}"
    version="${spec##*==}"
    if have "$name" "$version"; then
      echo "  $spec (present)"
    else
      echo "  $spec"
    fi
  done
  echo "with: $PY -m pip ${PIP_ARGS[*]} NAME==VERSION"
  exit 0
fi

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"
  version="${spec##*==}"
  n="$(norm "$name")"
  # One version of each: two wheels of one package stop the whole install there.
  for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    base="$(basename "$f" | tr '[:upper:]' '[:lower:]')"
    if [[ "$base" == "${n}-"* && "$base" != "${n}-${version}-"* ]]; then
      echo "removing $(basename "$f"): not the pinned $spec"
      rm -f "$f"
    fi
  done
  if have "$name" "$version"; then
    echo "present: $spec"
    continue
  fi
  echo "downloading: $spec"
  "$PY" -m pip -q "${PIP_ARGS[@]}" "$spec"
  have "$name" "$version" || {
    echo "gpu_bundle.sh: pip reported success but no wheel of $spec is in $DEST" >&2
    exit 1
  }
done

# Wheels that no line above names (left by hand or by an older list) would travel and install
# too: say so, and fail if any package has two.
declare -A seen=()
for f in "$DEST"/*.whl; do
  base="$(basename "$f")"
  n="$(norm "${base%%-*}")"
  if [ -n "${seen[$n]:-}" ]; then
    echo "gpu_bundle.sh: two wheels of $n in $DEST: ${seen[$n]} and $base; delete one" >&2
    exit 1
  fi
  seen[$n]="$base"
  known=0
  for spec in "${WHEELS[@]}"; do
    [ "$(norm "${spec%%==*}")" = "$n" ] && known=1
  done
  [ "$known" = 1 ] || echo "note: $base is in $DEST but not in this script's list; it travels too"
done

# What travels: tracked files plus untracked files git does not ignore (the device tool's rule),
# and the carried .whl.
tree_bytes="$(cd "$ROOT" && git ls-files -z -co --exclude-standard |
  xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')"
whl_bytes="$(du -sb "$DEST" | cut -f1)"
total=$((tree_bytes + whl_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "wheels: $(ls "$DEST"/*.whl | wc -l) files, $(mib "$whl_bytes"); tree: $(mib "$tree_bytes");" \
  "together: $(mib "$total") (limit ${LIMIT_MIB} MiB)"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_bundle.sh: the tree and .whl come to $(mib "$total"), over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
