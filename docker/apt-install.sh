#!/bin/sh
# The images' apt step (Dockerfile, Dockerfile.quant): apt-install.sh PACKAGE...
# APT_MIRROR (a build arg) replaces the host of Ubuntu's and Debian's archives for this step only,
# e.g. https://mirrors.tuna.tsinghua.edu.cn; the base's sources are restored afterwards. NVIDIA's
# CUDA apt repository is left out of the step: nothing is installed from it.
# An https mirror needs a CA store, which slim bases (debian:bookworm-slim, a debootstrap minbase)
# lack: there ca-certificates comes first from the same mirror over http. apt checks every package
# against the archive's signed Release file, so http changes how the files travel, not what gets
# installed.
set -eu
orig=$(mktemp -d)
cp -a /etc/apt/sources.list* "$orig"/
rm -f /etc/apt/sources.list.d/cuda*.list /etc/apt/sources.list.d/nvidia*.list

use_mirror() {  # use_mirror URL: every Ubuntu or Debian archive host becomes URL
    find /etc/apt -maxdepth 2 \( -name sources.list -o -name '*.list' -o -name '*.sources' \) -type f -print0 \
    | xargs -0 -r sed -i -E "s#https?://(archive|security|ports)\.ubuntu\.com#${1%/}#g; s#https?://(deb|security)\.debian\.org#${1%/}#g"
}
restore_sources() {
    rm -rf /etc/apt/sources.list /etc/apt/sources.list.d
    cp -a "$orig"/sources.list* /etc/apt/  # not "$orig"/.: that would give /etc/apt mktemp's mode 0700
}
install() {
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
}

if [ -n "${APT_MIRROR:-}" ]; then
    case "$APT_MIRROR" in
    https://*)
        if [ ! -s /etc/ssl/certs/ca-certificates.crt ]; then
            rest=${APT_MIRROR#https://}
            host=${rest%%/*}
            plain=http://${host%:443}${rest#"$host"}
            echo "apt-install: APT_MIRROR is https and the base has no CA store: ca-certificates first, from $plain"
            use_mirror "$plain"
            install ca-certificates
            restore_sources
        fi ;;
    esac
    use_mirror "$APT_MIRROR"
fi
install "$@"
rm -rf /var/lib/apt/lists/*
restore_sources
rm -rf "$orig"
