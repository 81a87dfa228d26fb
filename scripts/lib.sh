# Shared by scripts/*.sh: install what is missing, build and install pg_once, and run
# throwaway PostgreSQL clusters. Source it; do not run it.
#
# Everything here runs as root (as on our CI machines). PostgreSQL refuses to run as root,
# so clusters are created and started as the `postgres` user under $PG_ONCE_WORK.
#
# PG_MAJOR (set before sourcing; test.sh's --pg) picks the PostgreSQL: 15, the host's, by
# default; 17 or 18 run in a Debian chroot (scripts/pg-versions.sh). Either way
# $PG_BIN/<program> runs that version's program (for a chroot, a wrapper that enters it)
# and pg_server <program> runs a server program as postgres.

set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PGRX_VERSION=0.18.1
# Clusters live outside root's home so the postgres user can write them.
export PG_ONCE_WORK=${PG_ONCE_WORK:-/var/tmp/pg_once}
source "$REPO_ROOT/scripts/pg-versions.sh"
PG_MAJOR=${PG_MAJOR:-15}
if [ "$PG_MAJOR" = 16 ]; then
    # PyPI's build of 16 (pg-versions.sh), run on the host like 15.
    PG_BIN=$(pg_wheel_bin)
    PG_BIN_INSIDE=$PG_BIN
    unset PG_ONCE_PG_BIN_SWITCHES_USER
elif [ "$PG_MAJOR" = 15 ]; then
    # PG_ONCE_PG_BIN: another PostgreSQL 15 installation's bin directory, e.g. a copy of
    # the system one (a copied installation finds its lib/ and share/ relative to bin/),
    # so that two checkouts can install and test their builds side by side
    # (CONTRIBUTING.md).
    PG_BIN=${PG_ONCE_PG_BIN:-/usr/lib/postgresql/15/bin}
    # Where the programs see their bin directory (pg_regress --bindir).
    PG_BIN_INSIDE=$PG_BIN
    unset PG_ONCE_PG_BIN_SWITCHES_USER
else
    # Wrappers that enter the chroot (pg_env_wrappers, written by ensure_toolchain).
    PG_BIN=$PG_ONCE_WORK/pg$PG_MAJOR-bin
    PG_BIN_INSIDE=/usr/lib/postgresql/$PG_MAJOR/bin
    # Read by pg_test/multi's pg_ctl: the wrappers switch to postgres themselves.
    export PG_ONCE_PG_BIN_SWITCHES_USER=1
    # Files the chroot's programs write for the host (pg_dump's in the tokens test).
    export TMPDIR=$PG_ONCE_WORK/tmp
fi
export PG_ONCE_PG_BIN=$PG_BIN   # the crash tests restart the cluster with its pg_ctl
PG_CONFIG=$PG_BIN/pg_config
# pgrx otherwise builds the extension with different linker flags than `cargo test`
# does, which rebuilds every dependency twice.
export CARGO_PGRX_DISABLE_GC_SECTIONS_WORKAROUND=1

DEBIAN_PACKAGES=(sudo postgresql-15 postgresql-server-dev-15 libclang-dev clang pgbouncer
                 pkg-config libssl-dev build-essential curl prometheus-postgres-exporter
                 prometheus chromium postgresql-15-cron patroni etcd-server)

# pg_once's version: Cargo.toml's, the one place it is written (the control file's
# default_version, the packages and META.json take it from there).
cargo_version() {
    cargo metadata --no-deps --format-version 1 --manifest-path "$REPO_ROOT/Cargo.toml" |
        python3 -c 'import json, sys
print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "pg_once"))'
}

# say MESSAGE: a step's heading, with the seconds since this script started, so that a
# run's log tells what each step took.
say() { printf '\033[1m==> [%4d s] %s\033[0m\n' "$SECONDS" "$*" >&2; }

# Debian packages, cargo-pgrx and `cargo pgrx init`, each only when missing; for a
# PG_MAJOR other than 15, its chroot too, mounted until pg_env_umount (the caller's EXIT
# trap must call it).
ensure_toolchain() {
    local missing=()
    for p in "${DEBIAN_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        say "installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if ! cargo pgrx --version 2>/dev/null | grep -q "$PGRX_VERSION"; then
        # A debug build: cargo-pgrx only drives cargo, pg_config and initdb, so its own
        # speed is not felt, while its release build (LTO, opt-level 3 over ~300 crates)
        # was the longest single step of a cold CI run.
        say "installing cargo-pgrx $PGRX_VERSION (a debug build: about 3 minutes of CPU, once)"
        cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --debug
    fi
    mkdir -p "$PG_ONCE_WORK"
    chown postgres "$PG_ONCE_WORK"
    if [ "$PG_MAJOR" = 15 ] || [ "$PG_MAJOR" = 16 ]; then
        [ "$PG_MAJOR" = 16 ] && pg_wheel_ensure
        if ! grep -qs "^pg$PG_MAJOR = \"$PG_CONFIG\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
            say "cargo pgrx init --pg$PG_MAJOR $PG_CONFIG"
            cargo pgrx init "--pg$PG_MAJOR" "$PG_CONFIG" >/dev/null
        fi
        return
    fi
    pg_env_ensure "$PG_MAJOR"
    pg_env_mount "$PG_MAJOR"
    pg_env_wrappers "$PG_MAJOR" "$PG_BIN"
    mkdir -p "$TMPDIR"
    chmod 1777 "$TMPDIR"
    # The chroot's own pgrx home (pg_env_run), naming the chroot's pg_config.
    pg_env_run "$PG_MAJOR" sh -c "grep -qs '^pg$PG_MAJOR = ' \$PGRX_HOME/config.toml ||
        cargo pgrx init --pg$PG_MAJOR $PG_BIN_INSIDE/pg_config >/dev/null"
}

# pg_server PROGRAM ARGS...: a server program (initdb, pg_ctl, pg_basebackup) as postgres.
pg_server() {
    local program=$1; shift
    if [ -n "${PG_ONCE_PG_BIN_SWITCHES_USER:-}" ]; then
        "$PG_BIN/$program" "$@"
    else
        runuser -u postgres -- "$PG_BIN/$program" "$@"
    fi
}

# pg_build CMD...: run a build command (cargo pgrx ...) where PG_MAJOR's headers are: on
# the host for 15, inside the chroot otherwise (its own target directory and pgrx home).
pg_build() {
    if [ -z "${PG_ONCE_PG_BIN_SWITCHES_USER:-}" ]; then
        "$@"
    else
        pg_env_run "$PG_MAJOR" "$@"
    fi
}

# pgxs_test_program SUITE PROGRAM: PostgreSQL's pg_regress or pg_isolation_regress.
pgxs_test_program() {
    if [ -z "${PG_ONCE_PG_BIN_SWITCHES_USER:-}" ]; then
        echo "$($PG_CONFIG --pkglibdir)/pgxs/src/test/$1/$2"
    else
        echo "$PG_BIN/$2"
    fi
}

# install_extension [release|debug]: build pg_once and install it into PG_MAJOR's
# PostgreSQL. Tests use the quicker debug build; the demo and benchmarks use release.
install_extension() {
    local profile=${1:-release} log=$PG_ONCE_WORK/install.log
    say "building and installing pg_once ($profile)"
    local flags=()
    [ "$profile" = release ] && flags=(--release)
    if ! (cd "$REPO_ROOT" && pg_build cargo pgrx install "${flags[@]}" --pg-config "$PG_BIN_INSIDE/pg_config") >"$log" 2>&1; then
        tail -40 "$log" >&2
        echo "cargo pgrx install failed; full log in $log" >&2
        exit 1
    fi
}

# cluster_start NAME PORT [postgresql.conf lines...]
# A fresh cluster in $PG_ONCE_WORK/NAME, listening on 127.0.0.1:PORT and a socket in its
# own directory, trust authentication, database "postgres" and superuser "postgres".
cluster_start() {
    local name=$1 port=$2; shift 2
    local dir=$PG_ONCE_WORK/$name
    cluster_stop "$name"
    rm -rf "$dir"
    runuser -u postgres -- mkdir -p "$dir"
    pg_server initdb -D "$dir/data" -U postgres -A trust \
        --no-sync -E UTF8 --locale=C.UTF-8 >/dev/null
    {
        echo "port = $port"
        echo "listen_addresses = '127.0.0.1'"
        echo "unix_socket_directories = '$dir'"
        echo "max_connections = 300"
        echo "max_prepared_transactions = 10"   # tests PREPARE TRANSACTION with pg_once calls
        echo "shared_buffers = 256MB"
        echo "fsync = off"                 # throwaway cluster: durability across OS crashes is not tested
        echo "full_page_writes = off"
        echo "log_min_messages = warning"
        echo "log_line_prefix = '%m [%p] '"
        for line in "$@"; do echo "$line"; done
    } >>"$dir/data/postgresql.conf"
    pg_server pg_ctl -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null
}

# tls_certificates DIR: a private CA (DIR/ca.crt) and a server certificate it signed
# (DIR/server.crt, its key DIR/server.key readable by postgres alone) for 127.0.0.1 and
# localhost, both as subjectAltNames, so that sslmode=verify-full holds for either name.
# Made once per DIR; a second call keeps them.
tls_certificates() {
    local dir=$1
    [ -s "$dir/server.crt" ] && return 0
    mkdir -p "$dir"
    # A v3 CA (basicConstraints CA:TRUE): rustls, like every webpki verifier, refuses a
    # certificate whose issuer is not marked as a CA.
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -days 3650 \
        -subj "/CN=pg_once test CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        2>/dev/null
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
        -subj "/CN=127.0.0.1" -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature" \
        "extendedKeyUsage=serverAuth" "subjectAltName=IP:127.0.0.1,DNS:localhost" >"$dir/server.ext"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
        -CAcreateserial -days 3650 -extfile "$dir/server.ext" -out "$dir/server.crt" 2>/dev/null
    chown postgres "$dir/server.key" "$dir/server.crt"
    chmod 600 "$dir/server.key"
}

# cluster_tls NAME PORT [ROLE]: make the running cluster NAME (on 127.0.0.1:PORT) serve TLS
# with a certificate of a private CA ($PG_ONCE_WORK/tls, tls_certificates) and refuse TCP
# connections without it. With no ROLE, every TCP connection must use TLS (pg_hba.conf has
# hostssl lines only for TCP), as on a managed server that forces SSL. With ROLE (a login
# superuser it creates), only that role must use TLS and every other one may still connect
# over plain TCP: one server then serves both the tests that connect without TLS and the
# TLS-only case, rather than a second server for the TLS case alone. Reloads the cluster,
# checks that a TLS connection is verified and a plain one refused, and exports
# PG_ONCE_TLS_DSN (libpq conninfo, sslmode=verify-full with the CA as sslrootcert) and
# PG_ONCE_TLS_URL (the same as a postgres:// URL).
cluster_tls() {
    local name=$1 port=$2 role=${3:-}
    local dir=$PG_ONCE_WORK/$name tls=$PG_ONCE_WORK/tls user=${3:-postgres}
    tls_certificates "$tls"
    {
        echo "ssl = on"
        echo "ssl_cert_file = '$tls/server.crt'"
        echo "ssl_key_file = '$tls/server.key'"
    } >>"$dir/data/postgresql.conf"
    {
        echo "local all all trust"
        echo "local replication all trust"
        echo "hostssl all all 127.0.0.1/32 trust"
        echo "hostssl replication all 127.0.0.1/32 trust"
        if [ -n "$role" ]; then
            echo "hostnossl all $role 127.0.0.1/32 reject"
            echo "host all all 127.0.0.1/32 trust"
            echo "host replication all 127.0.0.1/32 trust"
        fi
    } >"$dir/data/pg_hba.conf"
    if [ -n "$role" ]; then
        cluster_psql "$name" "$port" -q -c "CREATE ROLE $role LOGIN SUPERUSER"
    fi
    pg_server pg_ctl -D "$dir/data" reload >/dev/null
    export PG_ONCE_TLS_DSN="host=127.0.0.1 port=$port user=$user dbname=postgres sslmode=verify-full sslrootcert=$tls/ca.crt"
    export PG_ONCE_TLS_URL="postgres://$user@127.0.0.1:$port/postgres?sslmode=verify-full&sslrootcert=$tls/ca.crt"
    # The reload is asynchronous: wait until new connections get TLS.
    local i served=false
    for i in $(seq 50); do
        if [ "$("$PG_BIN/psql" "$PG_ONCE_TLS_DSN" -XAtc \
                'SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()' 2>/dev/null)" = t ]; then
            served=true
            break
        fi
        sleep 0.1
    done
    if ! $served; then
        echo "cluster $name does not serve TLS; see $dir/server.log" >&2
        return 1
    fi
    if "$PG_BIN/psql" "host=127.0.0.1 port=$port user=$user dbname=postgres sslmode=disable" \
            -XAtc 'SELECT 1' >/dev/null 2>&1; then
        echo "cluster $name still accepts $user over plain TCP" >&2
        return 1
    fi
}

# standby_start NAME PORT PRIMARY_PORT
# A hot standby of the cluster on 127.0.0.1:PRIMARY_PORT in $PG_ONCE_WORK/NAME, listening
# on 127.0.0.1:PORT and a socket in its own directory: a base backup taken with
# pg_basebackup -R (it then streams from the primary; wal_level replica and the replication
# lines of initdb's pg_hba.conf allow it) that keeps the primary's settings, preloading
# included. Stop it with cluster_stop NAME.
standby_start() {
    local name=$1 port=$2 primary_port=$3
    local dir=$PG_ONCE_WORK/$name
    cluster_stop "$name"
    rm -rf "$dir"
    runuser -u postgres -- mkdir -p "$dir"
    # --checkpoint=fast: the default spreads the backup's checkpoint over most of
    # checkpoint_timeout, minutes of waiting once the tests have dirtied some buffers.
    pg_server pg_basebackup -h 127.0.0.1 -p "$primary_port" -U postgres \
        -D "$dir/data" -R -X stream --no-sync --checkpoint=fast
    {
        echo "port = $port"
        echo "unix_socket_directories = '$dir'"
    } >>"$dir/data/postgresql.conf"
    pg_server pg_ctl -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null
}

cluster_stop() {
    local dir=$PG_ONCE_WORK/$1
    if [ -f "$dir/data/postmaster.pid" ]; then
        pg_server pg_ctl -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    fi
}

# cluster_psql NAME PORT [psql args...]
cluster_psql() {
    local name=$1 port=$2; shift 2
    "$PG_BIN/psql" -h "$PG_ONCE_WORK/$name" -p "$port" -U postgres -X -v ON_ERROR_STOP=1 "$@"
}

# pgbouncer_start NAME PORT SERVER_PORT [pool_size] [pool_mode]
# A PgBouncer (Debian's package) in $PG_ONCE_WORK/NAME on 127.0.0.1:PORT in front of the
# cluster on SERVER_PORT, transaction pooling with pool_size server connections (default 6)
# per database and user. Trust authentication for the users in its users.txt (postgres; add
# lines for more). The admin console (database pgbouncer, user postgres) takes RECONNECT.
pgbouncer_start() {
    local name=$1 port=$2 server_port=$3 pool_size=${4:-6} mode=${5:-transaction}
    local dir=$PG_ONCE_WORK/$name
    pgbouncer_stop "$name"
    rm -rf "$dir"
    runuser -u postgres -- mkdir -p "$dir"
    cat >"$dir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=$server_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir = $dir
auth_type = trust
auth_file = $dir/users.txt
admin_users = postgres
pool_mode = $mode
default_pool_size = $pool_size
max_client_conn = 4000
max_db_connections = $pool_size
ignore_startup_parameters = extra_float_digits,options
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
    echo '"postgres" ""' >"$dir/users.txt"
    chown -R postgres "$dir"
    runuser -u postgres -- pgbouncer -d -q "$dir/pgbouncer.ini"
    local i
    for i in $(seq 50); do
        [ -s "$dir/pgbouncer.pid" ] && "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$port" && return 0
        sleep 0.1
    done
    echo "pgbouncer $name did not start; see $dir/pgbouncer.log" >&2
    return 1
}

# kill_pidfile FILE: stop the process whose pid FILE holds, if any, and forget it.
kill_pidfile() {
    if [ -s "$1" ]; then
        kill "$(cat "$1")" 2>/dev/null || true
        rm -f "$1"
    fi
}

pgbouncer_stop() { kill_pidfile "$PG_ONCE_WORK/$1/pgbouncer.pid"; }

# exporter_start NAME PORT SERVER_PORT [ROLE]: Debian's prometheus-postgres-exporter in
# $PG_ONCE_WORK/NAME on 127.0.0.1:PORT, reading the database postgres of the cluster on
# SERVER_PORT as ROLE (default postgres) with pg_once's queries file
# (monitoring/postgres_exporter.yml) and none of its built-in metrics. Stop it with
# exporter_stop NAME.
exporter_start() {
    local name=$1 port=$2 server_port=$3 role=${4:-postgres}
    local dir=$PG_ONCE_WORK/$name
    exporter_stop "$name"
    rm -rf "$dir"
    mkdir -p "$dir"
    DATA_SOURCE_NAME="postgresql://$role@127.0.0.1:$server_port/postgres?sslmode=disable" \
        setsid prometheus-postgres-exporter --web.listen-address="127.0.0.1:$port" \
        --extend.query-path="$REPO_ROOT/monitoring/postgres_exporter.yml" \
        --disable-default-metrics --disable-settings-metrics >"$dir/exporter.log" 2>&1 &
    echo $! >"$dir/exporter.pid"
    local i
    for i in $(seq 50); do
        curl -fs -o /dev/null "http://127.0.0.1:$port/metrics" && return 0
        sleep 0.1
    done
    echo "postgres_exporter $name did not start; see $dir/exporter.log" >&2
    return 1
}

exporter_stop() { kill_pidfile "$PG_ONCE_WORK/$1/exporter.pid"; }
