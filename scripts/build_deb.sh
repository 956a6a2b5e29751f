#!/usr/bin/env bash
# Builds admitd's Debian package with dpkg-deb alone (no cargo plugin to install: on a fresh two-core
# machine that install took about 6 minutes of the test command):
#
#   scripts/build_deb.sh                 # the release build (cargo build --release), as shipped
#   scripts/build_deb.sh --profile dev   # the debug build the tests made (no compile; testing only)
#
# Prints the package's path (target/debian/admitd_VERSION_ARCH.deb) as its last line. The package
# holds the binary in /usr/bin, the hardened systemd unit (deploy/admitd.service, enabled at install,
# not started: the operator edits the config first), deploy/admitd.example.toml as the conffile
# /etc/admitd/admitd.toml, the docs, and the maintainer scripts of deploy/debian/: postinst makes the
# admitd system user and /var/lib/admitd, postrm removes the state directory on purge. Where
# deploy/debian/ says #DEBHELPER#, the systemd snippets Debian's dh_installsystemd writes are put
# (deploy/debian/systemd.*). Dependencies: what dpkg-shlibdeps finds the binary links to, and passwd
# (useradd, groupadd). Needs dpkg-dev (dpkg-deb, dpkg-shlibdeps) and, when not root, fakeroot.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=${2:?--profile needs release or dev}; shift 2 ;;
    *) echo "usage: scripts/build_deb.sh [--profile release|dev]" >&2; exit 2 ;;
  esac
done
case "$profile" in
  release) cargo build --release --locked --bin admitd >&2; bin=target/release/admitd ;;
  dev) bin=target/debug/admitd; [ -x "$bin" ] || cargo build --locked --bin admitd >&2 ;;
  *) echo "build_deb.sh: unknown profile $profile (release or dev)" >&2; exit 2 ;;
esac

version=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["packages"][0]["version"])')
arch=$(dpkg --print-architecture)
out=target/debian
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
pkg="$stage/admitd"

install -D -m 0755 "$bin" "$pkg/usr/bin/admitd"
# Without its debug information, as Debian's packages ship binaries (dh_strip): the debug build is
# 250 MB with it, 57 MB without.
strip --strip-debug "$pkg/usr/bin/admitd"
install -D -m 0644 deploy/admitd.example.toml "$pkg/etc/admitd/admitd.toml"
install -D -m 0644 deploy/admitd.service "$pkg/usr/lib/systemd/system/admitd.service"
for doc in README.md docs/operations.md docs/configuration.md; do
  install -D -m 0644 "$doc" "$pkg/usr/share/doc/admitd/$(basename "$doc")"
done
printf 'admitd\n\nCopyright: admitd contributors\nLicense: Apache-2.0\n' >"$pkg/usr/share/doc/admitd/copyright"
chmod 0644 "$pkg/usr/share/doc/admitd/copyright"

# The maintainer scripts: ours, with the systemd snippets where they say #DEBHELPER#.
mkdir -p "$pkg/DEBIAN"
for script in postinst prerm postrm; do
  snippet=deploy/debian/systemd.$script
  if [ -f "deploy/debian/$script" ]; then
    awk -v snippet="$snippet" '
      $0 == "#DEBHELPER#" { while ((getline line < snippet) > 0) print line; next }
      { print }' "deploy/debian/$script" >"$pkg/DEBIAN/$script"
  else
    { printf '#!/bin/sh\nset -e\n'; cat "$snippet"; printf 'exit 0\n'; } >"$pkg/DEBIAN/$script"
  fi
  chmod 0755 "$pkg/DEBIAN/$script"
done
printf '/etc/admitd/admitd.toml\n' >"$pkg/DEBIAN/conffiles"

# Shared libraries the binary links to, as Debian package names and versions.
mkdir -p "$stage/debian"
printf 'Source: admitd\n\nPackage: admitd\nArchitecture: any\n' >"$stage/debian/control"
shlibs=$(cd "$stage" && dpkg-shlibdeps -O "admitd/usr/bin/admitd" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
depends="${shlibs:+$shlibs, }passwd"
size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)

sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@DEPENDS@/$depends/" -e "s/@SIZE@/$size/" \
  deploy/debian/control.in >"$pkg/DEBIAN/control"
(cd "$pkg" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) \
  >"$pkg/DEBIAN/md5sums"

mkdir -p "$out"
deb="$out/admitd_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$pkg" "$deb" >&2
echo "$deb"
