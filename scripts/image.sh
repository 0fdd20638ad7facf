#!/usr/bin/env bash
# Build the CPU image, pagedserve:0.1.0-cpu, with the default model inside, on a machine whose Docker
# daemon reaches PyPI but no image registry:
#   1. the base image (an equivalent of python:3.11-slim-bookworm) is made locally when missing:
#      Debian bookworm from debootstrap (minbase) with Debian's own python3.11, venv and pip;
#   2. the CPU torch wheel is staged in ./wheels/ (git-ignored, inside the build context) from this
#      machine's pip configuration, so the image need not reach PyTorch's own index;
#   3. BuildKit builds only the stages the CPU variant needs (the legacy builder would also pull the
#      CUDA base), with --network host so pip reaches PyPI.
# Needs root (debootstrap) and a running dockerd. Environment overrides:
#   IMAGE (pagedserve:0.1.0-cpu), BASE_IMAGE (pagedserve-base:py3.11-bookworm),
#   WITH_DEFAULT_MODEL (true), DEBIAN_MIRROR (http://deb.debian.org/debian), TORCH_VERSION (2.13.0),
#   DOCKER (the client to build with; by default the first on PATH that can build with BuildKit).
# Extra arguments go to `docker build` (e.g. --no-cache).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-pagedserve:0.1.0-cpu}
BASE_IMAGE=${BASE_IMAGE:-pagedserve-base:py3.11-bookworm}
WITH_DEFAULT_MODEL=${WITH_DEFAULT_MODEL:-true}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

make_base() {
    local rootfs
    rootfs=$(mktemp -d /tmp/pagedserve-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' RETURN
    echo "image.sh: making $BASE_IMAGE with debootstrap (bookworm, minbase)" >&2
    debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-pip,python-is-python3,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR" >&2
    # debootstrap installs from bookworm only: add the update and security suites the official image
    # tracks, take their fixes, then drop the package lists (the Dockerfile updates when it installs).
    cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main
EOF
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    chroot "$rootfs" /bin/sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get upgrade -y -q && apt-get clean' >&2
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    : > "$rootfs/etc/resolv.conf"  # Docker bind-mounts its own at run time
    tar -C "$rootfs" --numeric-owner -c . | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' \
        - "$BASE_IMAGE" >&2
}

# A client that can build with BuildKit: one with the buildx plugin, or one older than Docker 23,
# whose BuildKit is built in (Debian bookworm's docker.io is 20.10; a newer client on PATH may lack
# buildx and refuse DOCKER_BUILDKIT=1).
pick_docker() {
    local candidate major
    for candidate in ${DOCKER:-} $(type -ap docker); do
        if "$candidate" buildx version > /dev/null 2>&1; then
            echo "$candidate"; return
        fi
        major=$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then
            echo "$candidate"; return
        fi
    done
    echo "image.sh: no docker client that builds with BuildKit (install buildx, or Debian's docker.io)" >&2
    exit 1
}
DOCKER=$(pick_docker)

if ! docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
    make_base
fi

# The CPU wheel this machine's pip finds for torch==$TORCH_VERSION (a local wheel folder or index),
# downloaded once into the build context; the Dockerfile installs a staged wheel when one is there.
mkdir -p wheels
if ! compgen -G "wheels/torch-${TORCH_VERSION}*.whl" > /dev/null; then
    pip download --quiet --no-deps "torch==${TORCH_VERSION}" -d wheels
fi
for wheel in wheels/torch-"${TORCH_VERSION}"*.whl; do
    case "$wheel" in
        *+cpu*) ;;
        *) echo "image.sh: $wheel is not a CPU build (the CUDA one is gigabytes); remove it and stage a +cpu wheel" >&2
           exit 1 ;;
    esac
done

# This machine's CA bundle for pip inside the build (a TLS-intercepting egress proxy), as a build
# secret: used by the pip runs, never stored in the image.
secret=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    secret=(--secret "id=ca-bundle,src=$PIP_CERT")
fi

DOCKER_BUILDKIT=1 "$DOCKER" build --network host "${secret[@]}" \
    --build-arg VARIANT=cpu \
    --build-arg CPU_BASE="$BASE_IMAGE" \
    --build-arg WITH_DEFAULT_MODEL="$WITH_DEFAULT_MODEL" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" \
    -t "$IMAGE" "$@" .
docker image inspect --format '{{.Id}} {{.Size}}' "$IMAGE"
