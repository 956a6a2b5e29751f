#!/usr/bin/env bash
# Builds the Debian package and proves it installs and serves, without touching the machine:
#
#   1. `scripts/build_deb.sh` (dpkg-deb) builds target/debian/admitd_VERSION_ARCH.deb: the binary,
#      the systemd unit, /etc/admitd/admitd.toml (a conffile) and the maintainer scripts that make
#      the admitd system user and /var/lib/admitd;
#   2. `dpkg --root SCRATCH -i` installs it into an empty scratch root. dpkg would run the
#      maintainer scripts inside SCRATCH with chroot, which needs a whole system there; instead they
#      run with --force-script-chrootless, and they (and deb-systemd-helper) write under
#      $DPKG_ROOT, so the admitd user lands in SCRATCH/etc/passwd and the unit is enabled in SCRATCH.
#      `systemctl` is replaced by a stub on PATH for the install, so no daemon-reload reaches the
#      machine's systemd;
#   3. the installed binary checks the installed config (`admitd check`), then serves on a free
#      port with that config (its state file moved into SCRATCH), answers /readyz and `admitd top`,
#      and writes its state file at shutdown; `dpkg --purge` then removes the state directory.
#
# Which build goes in: DEB_PROFILE (default `dev`, the build the tests already made, so packaging
# costs no compile). For a package to ship, build with the release profile: `scripts/build_deb.sh`
# (about 4 more minutes of cold build on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=${DEB_PROFILE:-dev}
deb=$(scripts/build_deb.sh --profile "$profile" | tail -n 1)
version=$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["packages"][0]["version"])')
arch=$(dpkg --print-architecture)
[ "$deb" = "target/debian/admitd_${version}_${arch}.deb" ] || { echo "unexpected package name: $deb"; exit 1; }
echo "built $deb"
depends=$(dpkg-deb --field "$deb" Depends)
[[ $depends == *libc6* && $depends == *passwd* ]] || { echo "package: its dependencies miss libc6 or passwd: $depends" >&2; exit 1; }

scratch=$(mktemp -d)
pid=""
cleanup() {
  [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT
root="$scratch/root"
# An empty dpkg database and the scratch root's own users.
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" "$root/etc" "$scratch/bin"
touch "$root/var/lib/dpkg/status" "$root/var/lib/dpkg/available"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
printf 'root:*:19000:0:99999:7:::\n' >"$root/etc/shadow"
printf 'root:*::\n' >"$root/etc/gshadow"
printf '#!/bin/sh\necho "systemctl $*: skipped for the scratch install" >&2\n' >"$scratch/bin/systemctl"
chmod 755 "$scratch/bin/systemctl"
# Not root: fakeroot lets dpkg and the postinst chown in the scratch root.
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(fakeroot)
dpkg_root() {
  PATH="$scratch/bin:$PATH" "${as_root[@]}" dpkg --root="$root" --force-script-chrootless \
    --force-depends --log=/dev/null "$@"
}
dpkg_root -i "$deb"

fail() { echo "package: $*" >&2; exit 1; }
for f in usr/bin/admitd etc/admitd/admitd.toml usr/lib/systemd/system/admitd.service; do
  [ -f "$root/$f" ] || fail "/$f is not installed"
done
grep -q '^/etc/admitd/admitd.toml$' "$root/var/lib/dpkg/info/admitd.conffiles" || fail "the config is not a conffile"
grep -q '^admitd:x:[0-9]*:[0-9]*:.*:/var/lib/admitd:/usr/sbin/nologin$' "$root/etc/passwd" || fail "no admitd system user"
[ "$(stat -c %a "$root/var/lib/admitd")" = 700 ] || fail "/var/lib/admitd is not 0700"
uid=$(awk -F: '$1 == "admitd" { print $3 }' "$root/etc/passwd")
[ "$(stat -c %u "$root/var/lib/admitd")" = "$uid" ] || [ "$(id -u)" -ne 0 ] || fail "/var/lib/admitd is not admitd's"
[ -L "$root/etc/systemd/system/multi-user.target.wants/admitd.service" ] || fail "the unit is not enabled"
grep -q '^ExecStart=/usr/bin/admitd serve --config /etc/admitd/admitd.toml$' "$root/usr/lib/systemd/system/admitd.service" || fail "the unit does not start the installed binary"
echo "installed into a scratch root: binary, unit (enabled), conffile, user admitd (uid $uid), /var/lib/admitd"

admitd="$root/usr/bin/admitd"
"$admitd" check --config "$root/etc/admitd/admitd.toml"

# The installed config, served on a free port, with its state file inside the scratch root.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
sed -e "s#^listen = .*#listen = \"127.0.0.1:$port\"#" \
    -e "s#\"/var/lib/admitd/state\"#\"$root/var/lib/admitd/state\"#" \
    "$root/etc/admitd/admitd.toml" >"$scratch/admitd.toml"
"$admitd" serve --config "$scratch/admitd.toml" 2>"$scratch/admitd.log" &
pid=$!
for _ in $(seq 100); do
  "$admitd" health --ready --listen "127.0.0.1:$port" --timeout 1s >/dev/null 2>&1 && break
  sleep 0.2
done
"$admitd" health --ready --listen "127.0.0.1:$port" || { cat "$scratch/admitd.log"; fail "the installed binary does not serve"; }
"$admitd" top --once --url "http://127.0.0.1:$port" >/dev/null || fail "admitd top cannot read the installed daemon"
kill -TERM "$pid"
wait "$pid" || fail "the installed binary did not stop cleanly"
pid=""
[ -s "$root/var/lib/admitd/state" ] || fail "no state file at shutdown"
echo "the installed binary checked its config, served and stopped, leaving its state file"

dpkg_root --purge admitd
[ ! -e "$root/var/lib/admitd" ] || fail "purge left /var/lib/admitd"
[ ! -e "$root/usr/bin/admitd" ] || fail "purge left the binary"
echo "package ok: $deb"
