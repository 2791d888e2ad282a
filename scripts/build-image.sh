#!/usr/bin/env bash
# Builds the gpu-mapper container image without an image registry: only Debian's and PyPI's are needed.
#
#   1. a Debian bookworm root filesystem from Debian packages (mmdebstrap: python3 and its libraries, nothing
#      to compile or test with), cached for a week in ~/.cache/gpu-mapper-image (--no-cache: build afresh);
#   2. the project's wheel and its dependencies' binary wheels for CPython 3.11 on x86_64 (pip, from PyPI),
#      installed into /usr/local/lib/python3.11/dist-packages, plus /usr/local/bin/gpu-mapper;
#   3. imported as an OCI image with podman (entrypoint gpu-mapper, OCI labels) and saved as an OCI archive.
#
# The result is the image the Containerfile at the root builds with `podman build` on a machine that can pull
# debian:bookworm-slim: the same Debian packages, the same wheels at the same paths, the same entrypoint.
#
# Usage: scripts/build-image.sh [--out DIR] [--no-cache] [--print-tag]
#   IMAGE=registry.example.com/gpu-mapper:0.1.0 scripts/build-image.sh   (default tag: see DEFAULT_IMAGE)
# Output: DIR/gpu-mapper-<version>.oci.tar (default DIR: dist/), the image in podman's local storage under the
# tag, and a last line `image <tag> <archive> <bytes of the unpacked image> <bytes of the archive>`.
# Push:  podman push <tag>     or     skopeo copy oci-archive:dist/gpu-mapper-<version>.oci.tar docker://<tag>
# Needs root (or a user namespace mmdebstrap can use), mmdebstrap, podman and python3 with pip.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
DEFAULT_IMAGE="ghcr.io/kubeedge-gpu-mapper/gpu-mapper:${VERSION}"
IMAGE="${IMAGE:-$DEFAULT_IMAGE}"
OUT=dist
USE_CACHE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --no-cache) USE_CACHE=0; shift ;;
    --print-tag) echo "$IMAGE"; exit 0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build-image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

SUITE=bookworm
# The Debian packages of the image (and nothing they only recommend): Python 3.11 with its standard library
# (asyncio, ssl, sqlite3), CA certificates for mqtts:// brokers with public certificates.
PACKAGES=python3,ca-certificates
# Python's ABI and the platforms whose wheels run on bookworm (glibc 2.36).
PY_VERSION=3.11
PLATFORMS=(manylinux2014_x86_64 manylinux_2_17_x86_64)
for minor in $(seq 18 36); do PLATFORMS+=("manylinux_2_${minor}_x86_64"); done

need() { command -v "$1" >/dev/null || { echo "build-image.sh: $1 is not installed ($2)" >&2; exit 1; }; }
need mmdebstrap "apt-get install mmdebstrap"
need podman "apt-get install podman"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
"$PYTHON" -m pip --version >/dev/null 2>&1 || { echo "build-image.sh: $PYTHON has no pip (scripts/bootstrap.sh makes .venv)" >&2; exit 1; }

# Reproducible where the inputs are: file times and the tarball's order come from the last commit's date.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
export SOURCE_DATE_EPOCH

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-mapper-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"

# --- 1. the Debian root filesystem ------------------------------------------------------------------------
cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/gpu-mapper-image"
key=$(printf '%s\n' "$SUITE" "$PACKAGES" "v2" | sha256sum | cut -c1-16)
base="$cache_dir/rootfs-$SUITE-$key.tar"
if [ "$USE_CACHE" = 1 ] && [ -f "$base" ] && [ -n "$(find "$base" -mtime -7)" ]; then
  echo "== Debian $SUITE root filesystem: cached $base" >&2
else
  echo "== Debian $SUITE root filesystem: mmdebstrap ($PACKAGES)" >&2
  mkdir -p "$cache_dir"
  rm -f "$cache_dir"/rootfs-*.tar "$cache_dir"/rootfs-*.tar.tmp  # older keys: not used again
  # No documentation, manual pages or translations; no apt lists or caches (mmdebstrap removes those).
  # Merged /usr set up by the hook, as debootstrap does: without it bookworm pulls in usrmerge and all of perl.
  mmdebstrap --variant=minbase --include="$PACKAGES" --format=tar \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
    --customize-hook='find "$1"/usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} +' \
    "$SUITE" "$base.tmp" >&2
  mv "$base.tmp" "$base"
fi

# --- 2. the wheels --------------------------------------------------------------------------------------
echo "== wheels for CPython $PY_VERSION" >&2
"$PYTHON" -m pip wheel --no-deps -q -w "$work/wheel" . >&2
wheel=$(ls "$work"/wheel/*.whl)
site="$work/root/usr/local/lib/python${PY_VERSION}/dist-packages"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
"$PYTHON" -m pip install -q --no-compile --target "$site" --only-binary=:all: --implementation cp \
  --python-version "$PY_VERSION" --abi "cp${PY_VERSION/./}" --abi abi3 --abi none "${platform_args[@]}" \
  "$wheel" >&2
# pip's scripts carry the build machine's interpreter path: the image has its own entrypoint below. pip itself
# comes in as a dependency of sqlite-utils (for its own install command, which gpu-mapper never runs): removed.
rm -rf "$site/bin" "$site"/pip "$site"/pip-*.dist-info
mkdir -p "$work/root/usr/local/bin"
cat > "$work/root/usr/local/bin/gpu-mapper" <<'EOF'
#!/usr/bin/python3
import sys

from mapper.cli import main

sys.exit(main())
EOF
chmod 0755 "$work/root/usr/local/bin/gpu-mapper"
mkdir -p "$work/root/var/lib/gpu-mapper" "$work/root/etc/gpu-mapper"
chmod 0700 "$work/root/var/lib/gpu-mapper"

# --- 3. one layer, imported as an OCI image ----------------------------------------------------------------
echo "== image $IMAGE" >&2
mkdir -p "$work/rootfs"
tar -C "$work/rootfs" -xf "$base"
cp -a "$work/root/." "$work/rootfs/"
# Byte code compiled once at build time, so that no start writes it (the root filesystem is read-only).
chroot "$work/rootfs" /usr/bin/python3 -m compileall -q -j 0 /usr/local/lib/python${PY_VERSION}/dist-packages \
  /usr/lib/python${PY_VERSION} >/dev/null 2>&1 || true
find "$work/rootfs" -newermt "@$SOURCE_DATE_EPOCH" -exec touch --no-dereference --date="@$SOURCE_DATE_EPOCH" {} +
tar -C "$work/rootfs" --sort=name --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" -cf "$work/layer.tar" .

revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
label() { printf -- '--change=LABEL %s=%s\n' "$1" "$2"; }
mapfile -t changes < <(
  label org.opencontainers.image.title gpu-mapper
  label org.opencontainers.image.description "KubeEdge device mapper that makes every GPU of an edge node a KubeEdge Device"
  label org.opencontainers.image.version "$VERSION"
  label org.opencontainers.image.revision "$revision"
  label org.opencontainers.image.created "$created"
  label org.opencontainers.image.licenses Apache-2.0
  label org.opencontainers.image.source https://github.com/kubeedge-gpu-mapper/gpu-mapper
  label org.opencontainers.image.base.name "debian:$SUITE (mmdebstrap --variant=minbase)"
)
old_id=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
podman import -q \
  --change 'ENTRYPOINT ["/usr/local/bin/gpu-mapper"]' \
  --change 'CMD ["run"]' \
  --change 'ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 GPU_MAPPER_DATA_DIR=/var/lib/gpu-mapper' \
  --change 'EXPOSE 9410/tcp' \
  --change 'WORKDIR /' \
  --change 'USER 0:0' \
  "${changes[@]}" \
  "$work/layer.tar" "$IMAGE" >/dev/null
new_id=$(podman image inspect --format '{{.Id}}' "$IMAGE")
# The image this tag named before, now nameless: removed unless a container still uses it.
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then podman rmi "$old_id" >/dev/null 2>&1 || true; fi
archive="$OUT/gpu-mapper-${VERSION}.oci.tar"
rm -f "$archive"
podman save -q --format oci-archive -o "$archive" "$IMAGE"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "image $IMAGE $archive $size $(stat -c %s "$archive")"
