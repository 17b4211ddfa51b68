#!/usr/bin/env bash
# Build kvtune's operator or proxy image without a Docker engine: a Debian bookworm root filesystem
# (debootstrap), kvtune installed into /opt/kvtune from a wheelhouse downloaded on this machine, committed as
# an OCI image (umoci) and written as an OCI archive (skopeo). The same image as deploy/docker/<kind>.Dockerfile
# describes for a machine that has Docker: `kvtune` as the entrypoint, numeric user 65532, no torch.
#
#   sudo scripts/build_image.sh operator            # dist/images/kvtune-operator-<version>.oci.tar
#   sudo scripts/build_image.sh proxy --out /tmp/x  # kvtune proxy, torch-free
#   sudo scripts/build_image.sh proxy --cache DIR   # reuse (or make) the base layers kept in DIR
#
# Three layers, so that what changes often is small: Debian (debootstrap, the slow part, the same for both
# kinds), the kind's Python dependencies, then kvtune itself. With --cache DIR the first two are kept in an
# OCI layout in DIR (the second keyed by pyproject.toml) and only kvtune's layer is built again; without it
# every layer is built afresh in a temporary folder. Beside the archive it writes the manifest's digest
# (<name>-<version>.digest, what a registry shows once the archive is copied there) and the resolved
# package versions (<name>-<version>.requirements.lock).
#
# Needs root (debootstrap and chroot), and: apt-get install debootstrap umoci skopeo. Then load or push it:
#   skopeo copy oci-archive:dist/images/kvtune-operator-0.1.0.oci.tar docker://REGISTRY/kvtune-operator:0.1.0
set -euo pipefail

usage() { echo "usage: $0 operator|proxy [--out DIR] [--cache DIR]" >&2; exit 2; }
die() { echo "build_image: error: $*" >&2; exit 1; }

kind="${1:-}"; shift || true
case "$kind" in
  operator | proxy) extra="$kind" ;;  # the pip extra, and the verb the image runs by default
  *) usage ;;
esac
out="dist/images"
cache=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || usage; out="$2"; shift 2 ;;
    --cache) [ $# -ge 2 ] || usage; cache="$2"; shift 2 ;;
    *) usage ;;
  esac
done

repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
[ "$(id -u)" = 0 ] || die "run as root: debootstrap and chroot need it"
for tool in debootstrap umoci skopeo flock "$python"; do
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
[ -n "$cache" ] || cache="$work/cache"
mkdir -p "$cache" "$out"
cache="$(cd "$cache" && pwd)"
out="$(cd "$out" && pwd)"
layout="$cache/oci"
step() { echo "== $*"; }

# One build at a time per cache: the layout's index is rewritten by every umoci command.
exec 9>"$cache/lock"
flock 9
[ -d "$layout" ] || umoci init --layout "$layout"
# grep reads the whole list: `grep -q` would stop at the first match and, under pipefail, umoci's SIGPIPE
# would make a tag that is there read as missing (the base was then built twice, and the images differed).
has_tag() { umoci ls --layout "$layout" | grep -x "$1" >/dev/null; }

base="base-bookworm"
final="build-$kind-$$"

# What no layer carries: apt's caches and lists, device nodes (the runtime mounts /dev), a resolv.conf of
# this machine's, the wheelhouse.
tidy() {
  rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/dev/* "$1"/tmp/*
  : >"$1/etc/resolv.conf"
}
in_root() {
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 \
    chroot "$1" "${@:2}"
}
repack() {  # bundle, tag, what the layer holds
  umoci repack --image "$layout:$2" --history.created_by "scripts/build_image.sh: $3" "$1"
  rm -rf "$1"
}

# 1. Debian's Python 3.11 (bookworm), nothing else but CA certificates: the layer both kinds share.
if has_tag "$base"; then
  step "base: Debian bookworm from the cache ($cache)"
else
  step "base: debootstrap bookworm (minbase) from $mirror"
  umoci new --image "$layout:$base"
  umoci unpack --image "$layout:$base" "$work/base" >/dev/null
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/base/rootfs" \
    "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  tidy "$work/base/rootfs"
  repack "$work/base" "$base" "Debian bookworm (debootstrap --variant=minbase), Python 3.11"
fi

# pyproject.toml pins the dependencies, and they sit on the base: a change to either is a new dependency
# layer, so both kinds always sit on the one base the cache holds now
base_id="$("$python" -c 'import json, sys
index = json.load(open(sys.argv[1]))
print(next(m["digest"] for m in index["manifests"]
           if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == sys.argv[2])[7:19])' \
  "$layout/index.json" "$base")"
deps="deps-$kind-$(sha256sum "$repo/pyproject.toml" | cut -c1-16)-$base_id"

# 2. kvtune's wheel, and every dependency downloaded here for CPython 3.11 on x86-64 Linux: installed in the
# root filesystem from that folder only (the chroot needs no network, and no certificates of ours).
step "wheelhouse: kvtune $version[$extra]"
wheels="$work/wheels"
mkdir -p "$wheels"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" "$repo"
wheel="$(cd "$wheels" && ls "kvtune-$version-"*.whl)"
if has_tag "$deps"; then
  step "dependencies of kvtune[$extra] from the cache"
else
  step "dependencies of kvtune[$extra] into /opt/kvtune"
  "$python" -m pip download --quiet --dest "$wheels" --only-binary=:all: --implementation cp \
    --python-version 3.11 --abi cp311 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform linux_x86_64 "$wheels/$wheel[$extra]"
  umoci unpack --image "$layout:$base" "$work/deps" >/dev/null
  root="$work/deps/rootfs"
  cp -a "$wheels" "$root/tmp/wheels"
  in_root "$root" /usr/bin/python3 -m venv /opt/kvtune
  # every wheel but kvtune's own, which is the next layer
  in_root "$root" sh -c 'cd /tmp/wheels && /opt/kvtune/bin/pip install --quiet --no-cache-dir --no-index \
    --no-deps $(ls *.whl | grep -v "^kvtune-")'
  tidy "$root"
  repack "$work/deps" "$deps" "the Python dependencies of kvtune[$extra] (pyproject.toml)"
fi

# 3. kvtune, on the dependencies: pip checks that they are all there (no index to fetch a missing one from).
step "kvtune $version into /opt/kvtune"
umoci unpack --image "$layout:$deps" "$work/image" >/dev/null
root="$work/image/rootfs"
cp "$wheels/$wheel" "$root/tmp/"
# By name and version from a folder (the wheel of this tree, nothing else). Compiled at install (the
# default): the root filesystem is read-only at run time, so Python never could.
in_root "$root" /opt/kvtune/bin/pip install --quiet --no-cache-dir --no-index --no-deps --find-links /tmp \
  "kvtune==$version"
# A name for user 65532, whose home is the pod's /tmp: kopf names its peering identity with getpass.getuser(),
# which looks the uid up, and a runtime sets HOME from here. Without it the operator stops at start.
echo "kvtune:x:65532:65532:kvtune:/tmp:/usr/sbin/nologin" >>"$root/etc/passwd"
echo "kvtune:x:65532:" >>"$root/etc/group"
in_root "$root" /opt/kvtune/bin/pip check >/dev/null || die "kvtune[$extra]'s dependencies are incomplete in the image"
in_root "$root" /opt/kvtune/bin/pip list --format=freeze >"$work/requirements.lock"  # name==version, never a file URL
cp "$work/requirements.lock" "$root/opt/kvtune/requirements.lock"
env -i PATH=/opt/kvtune/bin:/usr/bin HOME=/tmp PYTHONDONTWRITEBYTECODE=1 "$(command -v chroot)" \
  --userspec=65532:65532 "$root" kvtune "$kind" --help >/dev/null \
  || die "kvtune $kind --help fails inside the image, as user 65532"
tidy "$root"

# 4. The config, and the archive.
step "commit as an OCI image"
umoci repack --image "$layout:$final" --history.created_by "scripts/build_image.sh: kvtune $version" \
  "$work/image"
umoci config --image "$layout:$final" --os linux --architecture amd64 \
  --config.user 65532:65532 --config.workingdir / \
  --config.entrypoint kvtune --config.cmd "$kind" \
  --config.env PATH=/opt/kvtune/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env PYTHONUNBUFFERED=1 --config.env PYTHONDONTWRITEBYTECODE=1 \
  --config.label "org.opencontainers.image.title=$name" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.revision=$revision" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "org.opencontainers.image.source=https://github.com/kvtune/kvtune"
archive="$out/$name-$version.oci.tar"
rm -f "$archive"
skopeo copy --quiet "oci:$layout:$final" "oci-archive:$archive:$name:$version"
# kvtune's layer is this build's alone: the cache keeps the base and the current dependencies only
umoci rm --image "$layout:$final"
for stale in $(umoci ls --layout "$layout" | grep "^deps-$kind-" | grep -vx "$deps" || true); do
  umoci rm --image "$layout:$stale"
done
umoci gc --layout "$layout"
digest="$(tar -xOf "$archive" index.json | "$python" -c 'import json, sys; print(json.load(sys.stdin)["manifests"][0]["digest"])')"
echo "$digest" >"$out/$name-$version.digest"
cp "$work/requirements.lock" "$out/$name-$version.requirements.lock"
step "wrote $archive ($(du -h "$archive" | cut -f1), $digest)"
echo "push it:  skopeo copy oci-archive:$archive docker://REGISTRY/$name:$version"
