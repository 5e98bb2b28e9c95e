#!/usr/bin/env bash
# Builds the local base image vitserve-base:bookworm: a minimal Debian bookworm with its python3 (3.11)
# and python3-venv, made with debootstrap and imported with `docker import`.
#
# Why: the engine used here reaches no image registry, so the Dockerfiles cannot start FROM
# python:3.11-slim-bookworm. They take their base as ARG BASE_IMAGE; docker/test.sh passes this one.
# Elsewhere nobody needs this script: the Dockerfiles' default bases pull normally.
#
# Cached: the rootfs tarball (build/base/) and the image (its import message) carry a hash of this recipe; a rerun with
# an unchanged recipe does nothing, and one whose image was removed only re-imports the tarball.
#
# Usage: docker/build-base.sh [--force]       env: BASE_TAG, DEBIAN_MIRROR
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_TAG=${BASE_TAG:-vitserve-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
OUT=build/base
TARBALL=$OUT/rootfs.tar

log() { printf '[build-base] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

recipe_hash() {  # changes with the suite, the package list, or the code that makes the rootfs
  { echo "$SUITE $PACKAGES"; declare -f make_rootfs trim_rootfs; } | sha256sum | cut -c1-16
}

image_recipe() {
  docker image inspect --format '{{ .Comment }}' "$BASE_TAG" 2>/dev/null || true
}

make_rootfs() {
  local rootfs=$OUT/rootfs
  command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install -y debootstrap"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  log "debootstrap --variant=minbase $SUITE ($PACKAGES) from $MIRROR"
  nice -n 10 debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
    > "$OUT/debootstrap.log" 2>&1 || { tail -20 "$OUT/debootstrap.log" >&2; die "debootstrap failed (log: $OUT/debootstrap.log)"; }
  trim_rootfs "$rootfs"
  log "packing $TARBALL"
  tar --numeric-owner -C "$rootfs" -cf "$TARBALL.tmp" . && mv "$TARBALL.tmp" "$TARBALL"
  rm -rf "$rootfs"
}

trim_rootfs() {  # what a slim image leaves out: package caches, docs, man pages, other locales
  local r=$1
  rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/* "$r"/var/log/* \
         "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/tmp/* \
         "$r"/var/cache/debconf/*-old "$r"/var/lib/dpkg/*-old
  find "$r"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
  find "$r"/usr/lib/python3* -name '__pycache__' -type d -prune -exec rm -rf {} +
  printf 'deb %s %s main\n' "$MIRROR" "$SUITE" > "$r"/etc/apt/sources.list
}

import_image() {
  log "importing $TARBALL as $BASE_TAG"
  docker import \
    --message "vitserve-base recipe $1" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$TARBALL" "$BASE_TAG" >/dev/null
}

main() {
  local want; want=$(recipe_hash)
  mkdir -p "$OUT"
  if [ "${1:-}" = --force ]; then rm -f "$TARBALL" "$OUT/recipe"; fi
  if [ "$(image_recipe)" = "vitserve-base recipe $want" ] && [ "${1:-}" != --force ]; then
    log "$BASE_TAG is up to date (recipe $want)"; return
  fi
  if [ ! -f "$TARBALL" ] || [ "$(cat "$OUT/recipe" 2>/dev/null)" != "$want" ]; then
    make_rootfs && echo "$want" > "$OUT/recipe"
  fi
  import_image "$want"
  docker run --rm --network none "$BASE_TAG" python3 -c \
    'import ensurepip, ssl, sys, venv; print("python", sys.version.split()[0])' >&2 \
    || die "$BASE_TAG has no working python3 with venv"
  log "built $BASE_TAG ($(docker image inspect --format '{{.Size}}' "$BASE_TAG" | numfmt --to=iec))"
}

main "$@"
