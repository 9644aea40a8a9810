#!/bin/sh
# The tools `nox -s image-standin` builds with, from Debian's packages:
# buildah (a daemonless OCI builder) and mmdebstrap (the stand-in base's root
# filesystem). Installs only what is missing; needs root and apt-get.
set -eu
missing=""
command -v buildah >/dev/null 2>&1 || missing="$missing buildah"
command -v mmdebstrap >/dev/null 2>&1 || missing="$missing mmdebstrap"
if [ -z "$missing" ]; then
    echo "install-image-tools: buildah and mmdebstrap are installed"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-image-tools: missing:$missing; install them (Debian/Ubuntu:" \
        "apt-get install$missing) or build with docker/podman" >&2
    exit 1
fi
echo "install-image-tools: apt-get install$missing (from Debian's packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing
