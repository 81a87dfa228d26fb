# PostgreSQL majors other than the host's 15. Sourced by lib.sh; do not run it.
#
# No Debian release ships every PostgreSQL major, and the host (bookworm) ships only 15.
# 17 and 18 run in Debian chroots (below); 16 from PyPI's pgserver wheel, on the host
# (pg_wheel_ensure); 14, which nothing here ships, is only type-checked (pg_typecheck).
#
# PostgreSQL N (17, 18) runs in a debootstrap chroot of the Debian release that ships it, with
# postgresql-N, its server headers and clang inside; the host's Rust toolchain and
# cargo-pgrx are bind-mounted in, so nothing is built twice. Servers started inside listen
# on 127.0.0.1 like the host's: the test clients (Rust, Python, Node) run on the host.
#
#   pg_env_ensure N          create the chroot for N, or rebuild it if its recipe changed
#   pg_env_mount N           bind-mount what runs inside needs (unmounted by pg_env_umount N)
#   pg_env_run N CMD...      run CMD inside as root, in the caller's directory, with the
#                            chroot's Rust and pgrx environment (needs pg_env_mount)
#   pg_env_root N            the chroot's directory on the host
#   pg_env_wrappers N DIR    scripts in DIR that run N's programs inside (lib.sh's PG_BIN)
#   pg_env_prefetch N...     pg_env_ensure in the background
#
# The chroots are a cache under $PG_ONCE_CACHE (default /var/cache/pg_once): a chroot
# records the hash of its recipe (release, packages, the postgres user's ids, this file's
# PG_ENV_RECIPE_VERSION) in .pg_once-recipe; a mismatch rebuilds it from scratch. Its
# packages are upgraded (apt-get upgrade, which brings PostgreSQL's minor releases) when
# the last upgrade is older than PG_ONCE_CACHE_MAX_AGE_DAYS (7).

PG_ONCE_CACHE=${PG_ONCE_CACHE:-/var/cache/pg_once}
# Bump when the recipe below changes in a way its hash does not see.
PG_ENV_RECIPE_VERSION=1

# pg_env_release N: the Debian release that ships PostgreSQL N.
pg_env_release() {
    case $1 in
        17) echo trixie ;;
        18) echo sid ;;
        *) echo "no Debian release with PostgreSQL $1 is known here" >&2; return 1 ;;
    esac
}

pg_env_packages() {
    # sudo: cargo pgrx test --runas uses it.
    echo "postgresql-$1 postgresql-server-dev-$1 clang libclang-dev gcc make pkg-config libssl-dev ca-certificates sudo"
}

pg_env_root() { echo "$PG_ONCE_CACHE/pg$1-$(pg_env_release "$1")"; }

pg_env_recipe() {
    # The postgres user has the host's ids inside, so that files it writes in the shared
    # work directory belong to the same user on both sides.
    echo "release=$(pg_env_release "$1") packages=$(pg_env_packages "$1")" \
         "postgres=$(id -u postgres):$(id -g postgres) version=$PG_ENV_RECIPE_VERSION" |
        sha256sum | cut -c1-16
}

pg_env_ensure() {
    local n=$1 root release recipe
    root=$(pg_env_root "$n")
    release=$(pg_env_release "$n")
    recipe=$(pg_env_recipe "$n")
    mkdir -p "$PG_ONCE_CACHE"
    pg_env_host_tools
    # Up to date: nothing to do, and no lock to take. (A caller inside a run that has the
    # chroot mounted, such as package.sh from test.sh's step 8, holds the shared lock: the
    # exclusive one below would wait for it for ever.)
    if [ "$(cat "$root/.pg_once-recipe" 2>/dev/null)" = "$recipe" ] &&
        [ -n "$(find "$root/.pg_once-upgraded" -mtime -"${PG_ONCE_CACHE_MAX_AGE_DAYS:-7}" 2>/dev/null)" ]; then
        return 0
    fi
    (
        # Nothing of the caller's environment that points outside the chroot (test.sh's
        # TMPDIR is in the work directory, mounted only while tests run).
        unset TMPDIR
        # One creator at a time; a run that uses the chroot holds a shared lock (pg_env_mount).
        exec 9>"$root.lock"
        flock 9
        if [ "$(cat "$root/.pg_once-recipe" 2>/dev/null)" != "$recipe" ]; then
            say "creating the PostgreSQL $n chroot ($release) in $root (a few minutes, once)"
            pg_env_umount_all "$root"
            rm -rf --one-file-system "$root" "$root.new"
            local log=$PG_ONCE_CACHE/pg$n-create.log
            if ! pg_env_create "$n" "$root.new" >"$log" 2>&1; then
                tail -30 "$log" >&2
                pg_env_umount_all "$root.new"
                echo "creating the PostgreSQL $n chroot failed; full log in $log" >&2
                exit 1
            fi
            echo "$recipe" >"$root.new/.pg_once-recipe"
            touch "$root.new/.pg_once-upgraded"
            mv "$root.new" "$root"
        elif [ -z "$(find "$root/.pg_once-upgraded" -mtime -"${PG_ONCE_CACHE_MAX_AGE_DAYS:-7}")" ]; then
            say "upgrading the PostgreSQL $n chroot's packages"
            pg_env_apt "$root" update -qq
            pg_env_apt "$root" upgrade -y -qq >/dev/null
            touch "$root/.pg_once-upgraded"
        fi
    )
}

pg_env_host_tools() {
    command -v debootstrap >/dev/null && return
    say "installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}

# pg_env_prefetch N...: create or refresh these versions' chroots in the background (the
# network and dpkg, mostly), logging to $PG_ONCE_CACHE/pgN-prefetch.log. A run that needs
# one waits for it under the chroot's lock, and makes it itself if this failed.
pg_env_prefetch() {
    local n
    mkdir -p "$PG_ONCE_CACHE"
    pg_env_host_tools   # before any other apt-get of the host's can hold dpkg's lock
    for n in "$@"; do
        (pg_env_ensure "$n" >"$PG_ONCE_CACHE/pg$n-prefetch.log" 2>&1 &)
    done
}

# pg_env_apt ROOT ARGS...: apt-get inside ROOT. sid's Release file may have expired in the
# registry's copy; its signature is still checked.
pg_env_apt() {
    local root=$1; shift
    DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get -o Acquire::Check-Valid-Until=false "$@"
}

# pg_env_create N DIR: a fresh chroot in DIR. Every step's failure is returned (callers
# test it, which turns errexit off in here).
pg_env_create() {
    local n=$1 root=$2
    debootstrap --variant=minbase "$(pg_env_release "$n")" "$root" http://deb.debian.org/debian ||
        return 1
    # The host's postgres ids, before postgresql-common creates the user.
    chroot "$root" groupadd -g "$(id -g postgres)" postgres || return 1
    chroot "$root" useradd -o -u "$(id -u postgres)" -g postgres -d /var/lib/postgresql \
        -s /bin/bash postgres || return 1
    # No cluster is created inside: tests make their own.
    mkdir -p "$root/etc/postgresql-common/createcluster.d"
    echo "create_main_cluster = false" >"$root/etc/postgresql-common/createcluster.d/pg_once.conf"
    # postgresql-common's maintainer scripts need /proc (sid's fail without it).
    mount -t proc proc "$root/proc" || return 1
    local rc=0
    pg_env_apt "$root" update &&
        # shellcheck disable=SC2046
        pg_env_apt "$root" install -y --no-install-recommends $(pg_env_packages "$n") &&
        pg_env_apt "$root" clean || rc=1
    umount "$root/proc"
    return $rc
}

# The host paths bind-mounted at the same path inside: the toolchain, the checkout, the
# work directory (clusters, logs, the chroot's target directory).
pg_env_binds() {
    echo /proc /sys /dev /dev/shm /root/.cargo /root/.rustup "$REPO_ROOT" "$PG_ONCE_WORK"
}

# Mounts made by this shell, so that pg_env_umount unmounts only its own (another run may
# share the chroot).
declare -ga PG_ENV_MOUNTED=()

pg_env_mount() {
    local n=$1 root src
    root=$(pg_env_root "$n")
    [ -f "$root/.pg_once-recipe" ] || { echo "no PostgreSQL $n chroot: pg_env_ensure $n" >&2; return 1; }
    exec {PG_ENV_LOCK_FD}>"$root.lock"
    flock -s "$PG_ENV_LOCK_FD"
    for src in $(pg_env_binds); do
        [ -e "$src" ] || continue
        mkdir -p "$root$src"
        mount --bind "$src" "$root$src"
        PG_ENV_MOUNTED+=("$root$src")
    done
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}

# pg_env_umount: undo this shell's mounts, innermost first. Safe to call twice.
pg_env_umount() {
    local i
    for ((i = ${#PG_ENV_MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${PG_ENV_MOUNTED[$i]}" 2>/dev/null || umount -l "${PG_ENV_MOUNTED[$i]}" || true
    done
    PG_ENV_MOUNTED=()
    [ -n "${PG_ENV_LOCK_FD:-}" ] && exec {PG_ENV_LOCK_FD}>&- || true
    PG_ENV_LOCK_FD=
}

# pg_env_umount_all ROOT: every mount under ROOT (a chroot about to be deleted).
pg_env_umount_all() {
    local m
    for m in $(awk -v r="$1/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r); do
        umount "$m" 2>/dev/null || umount -l "$m" || true
    done
}

pg_env_run() {
    local n=$1; shift
    local root
    root=$(pg_env_root "$n")
    # The chroot has its own pgrx home (config.toml names its pg_config) and target
    # directory (its glibc is newer than the host's: nothing built inside runs outside).
    chroot "$root" /usr/bin/env HOME=/root PGRX_HOME=/root/.pgrx \
        CARGO_TARGET_DIR="$PG_ONCE_WORK/target-pg$n" \
        PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /bin/sh -c 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"' - "$PWD" "$@"
}

# pg_env_wrappers N DIR: a directory of scripts named like PostgreSQL N's programs (and
# pg_regress, pg_isolation_regress) that run them inside the chroot: server programs as
# postgres, clients as root. They must be called as root (runuser cannot chroot), with the
# chroot mounted.
pg_env_wrappers() {
    local n=$1 dir=$2 root bin tool as
    root=$(pg_env_root "$n")
    bin=/usr/lib/postgresql/$n/bin
    rm -rf "$dir"
    mkdir -p "$dir"
    for tool in "$root$bin"/* pg_regress pg_isolation_regress; do
        tool=$(basename "$tool")
        local path=$bin/$tool
        case $tool in
            pg_regress) path=/usr/lib/postgresql/$n/lib/pgxs/src/test/regress/pg_regress ;;
            pg_isolation_regress) path=/usr/lib/postgresql/$n/lib/pgxs/src/test/isolation/pg_isolation_regress ;;
        esac
        as=
        case $tool in
            initdb | pg_ctl | postgres | pg_basebackup | pg_upgrade | pg_resetwal | pg_rewind) as="runuser -u postgres --" ;;
        esac
        cat >"$dir/$tool" <<EOF
#!/bin/sh
# PostgreSQL $n's $tool, inside $root (written by scripts/pg-versions.sh).
exec chroot "$root" /bin/sh -c 'cd "\$1" 2>/dev/null || cd /; shift; exec "\$@"' - "\$PWD" $as "$path" "\$@"
EOF
        chmod +x "$dir/$tool"
    done
}

# PostgreSQL 16 is shipped by no Debian release, but PyPI's pgserver wheel holds a
# relocatable build of 16.2 with its server headers, pg_config and pg_regress: it runs on
# the host like 15 does, from $PG_ONCE_CACHE/pg16-pgserver.
PG16_WHEEL=pgserver==0.1.4

pg_wheel_bin() { echo "$PG_ONCE_CACHE/pg16-pgserver/pgserver/pginstall/bin"; }

# pg_wheel_ensure: download and unpack the wheel unless it is there.
pg_wheel_ensure() {
    local dir=$PG_ONCE_CACHE/pg16-pgserver
    [ "$(cat "$dir/.pg_once-recipe" 2>/dev/null)" = "$PG16_WHEEL" ] && return
    say "fetching PostgreSQL 16 ($PG16_WHEEL from PyPI)"
    rm -rf "$dir" "$dir.new"
    mkdir -p "$dir.new"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.11 \
        "$PG16_WHEEL" -d "$dir.new"
    python3 -c 'import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extractall(sys.argv[1])' "$dir.new"
    rm -f "$dir.new"/*.whl
    # Zip files keep no modes: the programs must run, as postgres too.
    chmod -R a+rX "$dir.new"
    chmod a+x "$dir.new"/pgserver/pginstall/bin/* \
        "$dir.new"/pgserver/pginstall/lib/postgresql/pgxs/src/test/*/pg_*regress \
        "$dir.new"/pgserver/pginstall/lib/postgresql/pgxs/src/test/isolation/isolationtester
    echo "$PG16_WHEEL" >"$dir.new/.pg_once-recipe"
    mv "$dir.new" "$dir"
}

# pg_typecheck N: type-check and lint pg_once (library and #[pg_test]s) for PostgreSQL N against the
# bindings pgrx-pg-sys ships for every version it supports, for a version no Debian
# release ships (14, 16): DOCS_RS=1 makes pgrx-pg-sys skip bindgen, and --cfg docsrs,
# given to that crate only, makes it include its shipped bindings.
pg_typecheck() {
    local n=$1 wrapper=$PG_ONCE_WORK/rustc-docsrs
    mkdir -p "$PG_ONCE_WORK"
    cat >"$wrapper" <<'SH'
#!/bin/sh
# RUSTC_WRAPPER for pg_typecheck (scripts/pg-versions.sh): --cfg docsrs for pgrx-pg-sys.
rustc=$1; shift
case " $* " in *" --crate-name pgrx_pg_sys "*) exec "$rustc" "$@" --cfg docsrs ;; esac
exec "$rustc" "$@"
SH
    chmod +x "$wrapper"
    (cd "$REPO_ROOT" &&
        DOCS_RS=1 RUSTC_WRAPPER=$wrapper CARGO_TARGET_DIR=$PG_ONCE_WORK/target-typecheck \
            cargo clippy --quiet --lib --tests --no-default-features --features "pg$n pg_test" \
                -- -D warnings)
}
