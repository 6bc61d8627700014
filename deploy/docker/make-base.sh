#!/bin/sh
# deploy/docker/make-base.sh [TAG]: a Debian bookworm base image with Python 3.11, for machines
# that reach no container registry (only Debian's package mirror).  Root only.
#
# debootstrap (installed with apt-get where missing) makes a minimal root file system with python3 and
# python3-venv; its tarball is kept in $FEDHOP_CACHE (default /var/cache/fedhop-deploy) so that the
# next call only imports it; `docker import` turns it into TAG (default fedhop-base:bookworm).
# Then: docker build --build-arg BASE_IMAGE=fedhop-base:bookworm -t fedhop:cpu .
set -eu
tag=${1:-fedhop-base:bookworm}
cache=${FEDHOP_CACHE:-/var/cache/fedhop-deploy}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
tarball=$cache/bookworm-python3-rootfs.tar
# progress START: debootstrap's "I: Phase thing..." lines on stdin, the first of each phase said
# ("Retrieving", "Validating", "Extracting", "Unpacking", "Configuring", ...) and every 40th line
# after, with the seconds since START: a few dozen lines for the ~500 debootstrap writes
progress() {
    seen=" " n=0
    while IFS= read -r line; do
        case "$line" in "I: "*) ;; *) continue ;; esac
        n=$((n + 1))
        word=${line#I: }
        word=${word%% *}
        case "$seen" in
        *" $word "*) [ $((n % 40)) -eq 0 ] || continue ;;
        *) seen="$seen$word " ;;
        esac
        echo "make-base: debootstrap: ${line#I: } ($(( $(date +%s) - $1 )) s)" >&2
    done
    return 0
}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "make-base: $tag is already there"
    exit 0
fi
if [ ! -s "$tarball" ]; then
    if ! command -v debootstrap >/dev/null; then
        if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
            echo "make-base: debootstrap is not installed (apt-get install -y debootstrap)" >&2
            exit 2
        fi
        echo "make-base: apt-get install debootstrap" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null \
            || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y \
                 --no-install-recommends debootstrap >/dev/null; } \
            || { echo "make-base: apt-get install debootstrap failed" >&2; exit 2; }
    fi
    mkdir -p "$cache"
    root=$(mktemp -d "$cache/rootfs.XXXXXX")
    trap 'rm -rf "$root"' EXIT
    # debootstrap's own lines (hundreds, one per package) go to a log; its phases, with a package
    # count every 25 and the seconds so far, are said here as they happen
    echo "make-base: building $tag with debootstrap from $mirror: the first time only, about 3 minutes" \
         "(then cached in $tarball)" >&2
    start=$(date +%s)
    { rc=0; debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$mirror" 2>&1 || rc=$?; echo "$rc" >"$root.rc"; } \
        | tee "$root.log" | progress "$start"
    [ "$(cat "$root.rc")" = 0 ] || { tail -20 "$root.log" >&2; exit 1; }
    rm -f "$root.log" "$root.rc"
    # what an image never needs: package lists and caches, documentation, translations
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
           "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
    tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi
echo "make-base: docker import of $tarball as $tag" >&2
docker import --change 'CMD ["/bin/bash"]' "$tarball" "$tag" >/dev/null
echo "make-base: imported $tag from $tarball"
