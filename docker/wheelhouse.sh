#!/usr/bin/env bash
# Downloads the wheels an image's build installs into build/wheels/FLAVOR (cpu, gpu, train), for builds
# that cannot reach a package index (docker/test.sh builds with --network none). Cached: a flavor whose
# requirement files have not changed since its last complete download is not fetched again.
#
# Usage: docker/wheelhouse.sh FLAVOR...          env: PYTHON (a python with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The images are CPython 3.11 on Debian bookworm (glibc 2.36). pip does not widen one --platform to
# older manylinux tags, so name them all.
TARGET=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311)
for tag in manylinux_2_36 manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 linux; do
  TARGET+=(--platform "${tag}_x86_64")
done

log() { printf '[wheelhouse] %s\n' "$*" >&2; }

requirement_files() {  # FLAVOR -> the files its Dockerfile installs from the wheelhouse
  case $1 in
    cpu|gpu) echo "docker/requirements-build.txt docker/requirements-$1.txt" ;;
    train) echo "docker/requirements-build.txt docker/requirements-train.txt constraints.txt" ;;
    *) log "unknown flavor '$1' (cpu, gpu, train)"; return 1 ;;
  esac
}

download() {  # download FLAVOR
  local flavor=$1 dir=build/wheels/$1 files want args=()
  files=$(requirement_files "$flavor")
  want=$(cat $files | sha256sum | cut -c1-16)
  if [ "$(cat "$dir/.complete" 2>/dev/null)" = "$want" ]; then
    log "$flavor: up to date ($(du -sh "$dir" | cut -f1), $(find "$dir" -name '*.whl' | wc -l) wheels)"; return
  fi
  for f in $files; do
    case $f in constraints.txt) args+=(torch -c "$f") ;; *) args+=(-r "$f") ;; esac
  done
  log "$flavor: downloading into $dir"
  rm -f "$dir/.complete" && mkdir -p "$dir"
  nice -n 10 "$PY" -m pip download --quiet --disable-pip-version-check --dest "$dir" "${TARGET[@]}" "${args[@]}"
  echo "$want" > "$dir/.complete"
  log "$flavor: $(du -sh "$dir" | cut -f1), $(find "$dir" -name '*.whl' | wc -l) wheels"
}

[ $# -gt 0 ] || { log "usage: $0 cpu|gpu|train ..."; exit 2; }
for flavor in "$@"; do download "$flavor"; done
