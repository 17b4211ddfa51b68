#!/usr/bin/env bash
# Build kvtune's operator or proxy image without a Docker engine: a Debian bookworm root filesystem
# (debootstrap), kvtune installed into /opt/kvtune from a wheelhouse downloaded on this machine, committed as
# an OCI image (umoci) and written as an OCI archive (skopeo). The same image as deploy/docker/<kind>.Dockerfile
# describes for a machine that has Docker: `kvtune` as the entrypoint, numeric user 65532, no torch.
#
#   sudo scripts/build_image.sh operator            # dist/images/kvtune-operator-<version>.oci.tar
#   sudo scripts/build_image.sh proxy --out /tmp/x  # kvtune proxy, torch-free
#
# Needs root (debootstrap and chroot), and: apt-get install debootstrap umoci skopeo. Then load or push it:
#   skopeo copy oci-archive:dist/images/kvtune-operator-0.1.0.oci.tar docker://REGISTRY/kvtune-operator:0.1.0
set -euo pipefail

usage() { echo "usage: $0 operator|proxy [--out DIR]" >&2; exit 2; }
die() { echo "build_image: error: $*" >&2; exit 1; }

kind="${1:-}"; shift || true
case "$kind" in
  operator | proxy) extra="$kind" ;;  # the pip extra, and the verb the image runs by default
  *) usage ;;
esac
out="dist/images"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || usage; out="$2"; shift 2 ;;
    *) usage ;;
  esac
done

repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
[ "$(id -u)" = 0 ] || die "run as root: debootstrap and chroot need it"
for tool in debootstrap umoci skopeo "$python"; do
  command -v "$tool" >/dev/null || die "$tool not found; as root: apt-get install -y debootstrap umoci skopeo"
done
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip (set PYTHON=.venv/bin/python)"
version="$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$repo/pyproject.toml")"
revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
[ -z "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ] || revision="$revision-dirty"
name="kvtune-$kind"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
step() { echo "== $*"; }

# 1. Debian's Python 3.11 (bookworm), nothing else but CA certificates.
step "debootstrap bookworm (minbase) from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
  >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }

# 2. kvtune's wheel and every dependency, downloaded here for CPython 3.11 on x86-64 Linux, then installed
# in the root filesystem from that folder only (the chroot needs no network, and no certificates of ours).
step "wheelhouse: kvtune $version[$extra]"
wheels="$rootfs/tmp/wheels"
mkdir -p "$wheels"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" "$repo"
"$python" -m pip download --quiet --dest "$wheels" --only-binary=:all: --implementation cp \
  --python-version 3.11 --abi cp311 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform linux_x86_64 "$wheels/kvtune-$version-py3-none-any.whl[$extra]"
in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$rootfs" "$@"; }
step "install into /opt/kvtune"
in_root /usr/bin/python3 -m venv /opt/kvtune
in_root /opt/kvtune/bin/pip install --quiet --no-cache-dir --no-index --find-links /tmp/wheels "kvtune[$extra]"
in_root /opt/kvtune/bin/pip freeze --all >"$work/requirements.lock"
cp "$work/requirements.lock" "$rootfs/opt/kvtune/requirements.lock"
env -i PATH=/opt/kvtune/bin:/usr/bin HOME=/tmp "$(command -v chroot)" --userspec=65532:65532 "$rootfs" kvtune "$kind" --help \
  >/dev/null || die "kvtune $kind --help fails inside the image, as user 65532"

# 3. What an image does not carry: the wheelhouse, apt's caches, device nodes (the runtime mounts /dev).
rm -rf "$wheels" "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/dev/* "$rootfs"/tmp/*
: >"$rootfs/etc/resolv.conf"
find "$rootfs/opt/kvtune" -name __pycache__ -prune -exec rm -rf {} +

# 4. One layer, the config, and the archive.
step "commit as an OCI image"
layout="$work/oci"
umoci init --layout "$layout"
umoci new --image "$layout:$version"
umoci unpack --image "$layout:$version" "$work/bundle" >/dev/null
cp -a "$rootfs/." "$work/bundle/rootfs/"
umoci repack --image "$layout:$version" "$work/bundle"
umoci config --image "$layout:$version" --os linux --architecture amd64 \
  --config.user 65532:65532 --config.workingdir / \
  --config.entrypoint kvtune --config.cmd "$kind" \
  --config.env PATH=/opt/kvtune/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env PYTHONUNBUFFERED=1 --config.env PYTHONDONTWRITEBYTECODE=1 \
  --config.label "org.opencontainers.image.title=$name" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.revision=$revision" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "org.opencontainers.image.source=https://github.com/kvtune/kvtune"
umoci gc --layout "$layout"
mkdir -p "$out"
archive="$out/$name-$version.oci.tar"
rm -f "$archive"
skopeo copy --quiet "oci:$layout:$version" "oci-archive:$archive:$name:$version"
cp "$work/requirements.lock" "$out/$name-$version.requirements.lock"
step "wrote $archive ($(du -h "$archive" | cut -f1)) and $out/$name-$version.requirements.lock"
echo "push it:  skopeo copy oci-archive:$archive docker://REGISTRY/$name:$version"
