#!/usr/bin/env bash
# Build pg_once's distributable packages. Run as root on Debian, from a clone.
#
#   ./scripts/package.sh [--pg N] [--debug] [--out DIR]
#       a Debian package postgresql-N-pg-once_VERSION-1_ARCH.deb (default N: 15) for
#       Debian's (or apt.postgresql.org's) postgresql-N: pg_once.so in
#       /usr/lib/postgresql/N/lib; the control file, the install script and every upgrade
#       script of sql/ in /usr/share/postgresql/N/extension. Built with `cargo pgrx
#       package` (a release build, as shipped) and dpkg-deb. --debug packages the debug
#       build instead (quicker to build; what the tests install, see scripts/test.sh).
#   ./scripts/package.sh --pgxn [--out DIR]
#       a PGXN distribution pg_once-VERSION.zip: the committed tree (git archive HEAD) with
#       a META.json (PGXN Meta Spec 1.0.0) made from Cargo.toml.
#
# VERSION is Cargo.toml's. Packages go to DIR (default: dist/ in the clone, not committed).
#
# Other PostgreSQL versions: the library for N is built where scripts/test.sh --pg N builds
# it (lib.sh, PG_MAJOR): 17 and 18 inside their Debian chroots, 16 against PyPI's build;
# the package is put together on the host. Its Depends names Debian's postgresql-N.
pg=15 profile=release out=dist pgxn=false
while (($#)); do
    case $1 in
        --pg) pg=$2; shift 2 ;;
        --debug) profile=debug; shift ;;
        --out) out=$2; shift 2 ;;
        --pgxn) pgxn=true; shift ;;
        *) echo "usage: $0 [--pg N] [--debug] [--out DIR] | --pgxn [--out DIR]" >&2; exit 2 ;;
    esac
done
case $pg in
    15 | 16 | 17 | 18) ;;
    *) echo "$0: --pg $pg: packages are built for 15 to 18 (CONTRIBUTING.md, \"PostgreSQL versions\")" >&2
       exit 2 ;;
esac
# lib.sh's functions read PG_MAJOR when called, so it is set for good, not for `source`.
PG_MAJOR=$pg
source "$(dirname "$0")/lib.sh"
[ "$out" = dist ] && out=$REPO_ROOT/dist
mkdir -p "$out"
out=$(cd "$out" && pwd)
version=$(cargo_version)

# The PGXN distribution: META.json describes the release; PGXN lists it. (pgxn install
# runs make, which pg_once has not: users build it with cargo pgrx, see docs/operations.md.)
if $pgxn; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    python3 - "$version" "$REPO_ROOT" >"$tmp/META.json" <<'PY'
import json, re, sys, tomllib
from pathlib import Path
version, root = sys.argv[1], Path(sys.argv[2])
cargo = tomllib.loads((root / "Cargo.toml").read_text())["package"]
control = (root / "pg_once.control").read_text()
abstract = re.search(r"^comment = '(.*)'$", control, flags=re.M).group(1)
meta = {
    "name": "pg_once",
    "abstract": cargo["description"],
    "description": abstract,
    "version": version,
    "maintainer": ["pg_once developers"],
    "license": "postgresql",
    "provides": {
        "pg_once": {
            "abstract": cargo["description"],
            "file": "sql/functions.sql",
            "docfile": "docs/sql-reference.md",
            "version": version,
        }
    },
    "prereqs": {"runtime": {"requires": {"PostgreSQL": "14.0.0"}}},
    "release_status": "stable",
    "tags": ["cache", "queue", "fencing token", "lease", "notify"],
    "generated_by": "scripts/package.sh",
    "meta-spec": {"version": "1.0.0", "url": "https://pgxn.org/meta/spec.txt"},
}
print(json.dumps(meta, indent=2))
PY
    zip=$out/pg_once-$version.zip
    git -C "$REPO_ROOT" archive --format=zip --prefix="pg_once-$version/" \
        --add-file="$tmp/META.json" -o "$zip" HEAD
    say "built $zip"
    exit 0
fi

# PostgreSQL N's build environment: for 17 and 18 their chroot, mounted until exit.
stage=
trap 'rm -rf "$stage"; pg_env_umount' EXIT
ensure_toolchain

name=postgresql-$pg-pg-once
arch=$(dpkg --print-architecture)
deb=$out/${name}_$version-1_$arch.deb
# In the work directory, which a chroot sees at the same path.
stage=$(mktemp -d -p "$PG_ONCE_WORK" package.XXXXXX)
say "building $name $version ($profile) with cargo pgrx package"
flags=(--no-default-features --features "pg$pg" --pg-config "$PG_BIN_INSIDE/pg_config"
       --out-dir "$stage/pgrx")
[ "$profile" = debug ] && flags+=(--debug)
log=$out/$name.log
if ! (cd "$REPO_ROOT" && pg_build cargo pgrx package "${flags[@]}") >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "cargo pgrx package failed; full log in $log" >&2
    exit 1
fi

# cargo pgrx package lays files out where PG_CONFIG's installation keeps them (a copy of
# PostgreSQL under /opt, say); a Debian package puts them where Debian's postgresql-N does.
root=$stage/deb
lib=usr/lib/postgresql/$pg/lib
ext=usr/share/postgresql/$pg/extension
mkdir -p "$root/$lib" "$root/$ext" "$root/DEBIAN" "$root/usr/share/doc/$name"
cp "$stage/pgrx$("$PG_CONFIG" --pkglibdir)/pg_once.so" "$root/$lib/"
cp "$stage/pgrx$("$PG_CONFIG" --sharedir)"/extension/pg_once* "$root/$ext/"
# As Debian's dh_strip does for shared libraries: the debug build's symbols are 50 MB.
strip --remove-section=.comment --remove-section=.note --strip-unneeded "$root/$lib/pg_once.so"
chmod 0644 "$root/$lib/pg_once.so" "$root/$ext"/*
# Every upgrade script must ship, or ALTER EXTENSION pg_once UPDATE finds no path.
[ -f "$root/$ext/pg_once--$version.sql" ] || { echo "no install script pg_once--$version.sql" >&2; exit 1; }
for script in "$REPO_ROOT"/sql/pg_once--*.sql; do
    [ -e "$script" ] || continue
    cmp -s "$script" "$root/$ext/$(basename "$script")" ||
        { echo "$(basename "$script") is missing from the package" >&2; exit 1; }
done
cp "$REPO_ROOT/README.md" "$root/usr/share/doc/$name/"
gzip -9n "$root/usr/share/doc/$name/README.md"

# Depends: the server it was built for, and the shared libraries pg_once.so links.
mkdir -p "$stage/shlibs/debian"
printf 'Source: pg-once\n\nPackage: %s\nArchitecture: any\n' "$name" >"$stage/shlibs/debian/control"
shlibs=$(cd "$stage/shlibs" && dpkg-shlibdeps -O "$root/$lib/pg_once.so" 2>/dev/null |
         sed -n 's/^shlibs:Depends=//p')
cat >"$root/DEBIAN/control" <<CONTROL
Package: $name
Version: $version-1
Architecture: $arch
Maintainer: ${PG_ONCE_MAINTAINER:-pg_once developers <pg_once@invalid>}
Depends: postgresql-$pg${shlibs:+, $shlibs}
Section: database
Priority: optional
Installed-Size: $(du -sk "$root/usr" | cut -f1)
Description: PostgreSQL $pg extension: compute each cacheable key once across a fleet
 pg_once gives a fleet of processes claims with fencing tokens, takeover of dead
 owners, server-side waiting, NOTIFY on completion and a work queue, as SQL
 functions. Load it with shared_preload_libraries = 'pg_once' (see
 /usr/share/doc/$name/README.md.gz), then CREATE EXTENSION pg_once.
CONTROL
(cd "$root" && find usr -type f -exec md5sum {} + | sort -k2) >"$root/DEBIAN/md5sums"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
say "built $deb"
dpkg-deb --info "$deb" | sed -n 's/^ \(Package\|Version\|Depends\):/  \1:/p' >&2
dpkg-deb --contents "$deb" | awk '{print "  " $6}' | grep -v '/$' >&2
