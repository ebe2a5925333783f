#!/usr/bin/env bash
# Install the Mooncake Store baseline that `beluga bench store --baseline mooncake`
# runs next to Beluga.  Safe to run again: each step is skipped when already done.
#
#   ci/install-mooncake.sh              pip package, plus libibverbs1 from apt
#   ci/install-mooncake.sh --user-libs  pip package, plus libibverbs1 extracted
#                                       into $BELUGA_MOONCAKE_LIBDIR (no root)
#
# Why libibverbs: the wheel's shared objects link libibverbs.so.1 even when only
# TCP is used.  Without root (or with --user-libs) the .debs are downloaded and
# unpacked into BELUGA_MOONCAKE_LIBDIR, which beluga.kv.tier.mooncake reads (same
# default) to preload the library and to set LD_LIBRARY_PATH for Mooncake's
# processes.  PYTHON picks the interpreter (default: python3).
set -euo pipefail

MOONCAKE_PACKAGE=mooncake-transfer-engine-non-cuda
MOONCAKE_VERSION=0.3.13.post1
VERBS_PACKAGES=(libibverbs1 libnl-3-200 libnl-route-3-200)
PYTHON=${PYTHON:-python3}
LIBDIR=${BELUGA_MOONCAKE_LIBDIR:-${XDG_CACHE_HOME:-$HOME/.cache}/beluga/mooncake-libs}

user_libs=0
case "${1:-}" in
    "") ;;
    --user-libs) user_libs=1 ;;
    *) echo "usage: $0 [--user-libs]" >&2; exit 2 ;;
esac

say() { echo "install-mooncake: $*"; }

install_wheel() {
    local have
    # `pip show` exits 1 for a package that is not installed: not an error here
    have=$("$PYTHON" -m pip show "$MOONCAKE_PACKAGE" 2>/dev/null | sed -n 's/^Version: //p' || true)
    if [[ "$have" == "$MOONCAKE_VERSION" ]]; then
        say "$MOONCAKE_PACKAGE $have already installed"
        return
    fi
    say "pip install $MOONCAKE_PACKAGE==$MOONCAKE_VERSION"
    "$PYTHON" -m pip install --quiet "$MOONCAKE_PACKAGE==$MOONCAKE_VERSION" || {
        say "pip could not install $MOONCAKE_PACKAGE==$MOONCAKE_VERSION (with $PYTHON); check the network and run again" >&2
        return 1
    }
}

system_has_verbs() {
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '
}

install_verbs_with_apt() {
    say "apt-get install libibverbs1"
    if ! apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
    fi
}

# Unpack the three .debs and keep only their shared objects, flat in LIBDIR, so
# one LD_LIBRARY_PATH entry serves both /lib and /usr/lib layouts.
extract_verbs_to_libdir() (
    if [[ -e "$LIBDIR/libibverbs.so.1" ]]; then
        say "libibverbs.so.1 already in $LIBDIR"
        return
    fi
    local work
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    say "apt-get download ${VERBS_PACKAGES[*]} -> $LIBDIR"
    (cd "$work" && apt-get download -qq "${VERBS_PACKAGES[@]}" >/dev/null 2>&1) || {
        say "apt-get download failed; run 'apt-get update' (as root) and try again" >&2
        return 1
    }
    local deb
    for deb in "$work"/*.deb; do
        dpkg-deb -x "$deb" "$work/root"
    done
    mkdir -p "$LIBDIR"
    find "$work/root" -name '*.so*' \( -type f -o -type l \) -exec cp -P -t "$LIBDIR" {} +
    say "unpacked into $LIBDIR, where beluga.kv.tier.mooncake looks (BELUGA_MOONCAKE_LIBDIR overrides)"
)

install_wheel
if (( user_libs )); then
    extract_verbs_to_libdir
elif system_has_verbs; then
    say "libibverbs.so.1 already installed"
elif [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    install_verbs_with_apt || { say "apt-get install failed; extracting instead"; extract_verbs_to_libdir; }
else
    extract_verbs_to_libdir
fi
say "done"
