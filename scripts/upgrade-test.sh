# Step 9 of scripts/test.sh: an in-place upgrade from the last release. Sourced by
# test.sh after lib.sh, with the current tree already built (install_extension debug).
#
# On a copy of the PostgreSQL installation of $PG_BIN (so that nothing installed for the
# other steps changes), a preloaded server runs the last release exactly as it was cut
# (the last line of RELEASES: its version and commit, built from git), and a database is filled through that release's own
# functions (pg_test/upgrade/fill.sql). Then the current build is installed the way a
# package manager does it (new files, new inodes, the server still running), and:
#   (d) ALTER EXTENSION pg_once UPDATE, with the old library still loaded, is refused
#       with 55000 and a hint, and changes nothing;
#   (d) after a restart, the new library with the old SQL refuses every call with 55000
#       and a hint, and the worker says so once in the log;
#   ALTER EXTENSION pg_once UPDATE then runs the hand-written script sql/pg_once--*--*.sql;
#   (a) the schema equals a fresh install's (pg_dump --schema-only --binary-upgrade, which
#       unlike a plain dump writes out each of the extension's objects), grants on
#       functions the update replaced included;
#   (b) every row and the token sequence are as before (pg_test/upgrade/snapshot.sql);
#   (c) the multi-connection suite passes on the upgraded database;
#   (e) in a database whose owner made schema once and planted an operator in it before
#       pg_once was installed there, the update refuses (42501) before anything runs.

read -r UPGRADE_FROM UPGRADE_COMMIT < <(grep -v -e '^#' -e '^$' "$REPO_ROOT/RELEASES" | tail -n 1)

# upgrade_copy_installation DIR: copy the PostgreSQL installation of $PG_CONFIG (its
# bin/lib tree and its share tree) into DIR at the same relative places, without
# pg_once. A copied installation finds its lib/ and share/ relative to its bin/.
upgrade_copy_installation() {
    local root=$1 dir
    rm -rf "$root"
    for dir in "$("$PG_CONFIG" --bindir)/.." "$("$PG_CONFIG" --sharedir)"; do
        dir=$(realpath "$dir")
        mkdir -p "$root$(dirname "$dir")"
        cp -a "$dir" "$root$(dirname "$dir")/"
    done
    rm -f "$root$(realpath "$("$PG_CONFIG" --pkglibdir)")"/pg_once.so \
        "$root$(realpath "$("$PG_CONFIG" --sharedir)")"/extension/pg_once*
}

# upgrade_package SRC OUT: pg_once built from the tree SRC (debug, against $PG_CONFIG) as
# the files a package installs, under OUT.
upgrade_package() {
    local src=$1 out=$2 log=$2.log
    rm -rf "$out"
    if ! (cd "$src" && cargo pgrx package --debug --pg-config "$PG_CONFIG" --out-dir "$out") \
            >"$log" 2>&1; then
        tail -40 "$log" >&2
        echo "building pg_once from $src failed; full log in $log" >&2
        exit 1
    fi
}

# upgrade_install OUT ROOT: put the packaged files of OUT into the copied installation
# ROOT as dpkg does: each file written beside its destination, then renamed over it, so
# that a running server keeps the old library it mapped (an in-place overwrite would
# crash it).
upgrade_install() {
    local out=$1 root=$2 file dest
    (cd "$out" && find . -type f) | while read -r file; do
        dest=$root${file#.}
        mkdir -p "$(dirname "$dest")"
        cp "$out/$file" "$dest.new"
        mv -f "$dest.new" "$dest"
    done
}

# upgrade_build_release: the release's files, built once per commit, toolchain and
# PostgreSQL installation (its version and where it is: a package's files name the paths
# of the pg_config they were built with, and a copy of PostgreSQL has its own), and kept
# in $PG_ONCE_WORK/releases/ (a stale key means a rebuild).
upgrade_build_release() {
    local commit=$UPGRADE_COMMIT
    if ! git -C "$REPO_ROOT" cat-file -e "$commit^{commit}" 2>/dev/null; then
        # A shallow clone: fetch its history from where it was cloned.
        say "9/9 fetching the history of release $UPGRADE_FROM from the clone's origin"
        git -C "$REPO_ROOT" fetch --quiet --unshallow 2>/dev/null || true
    fi
    if ! git -C "$REPO_ROOT" cat-file -e "$commit^{commit}" 2>/dev/null; then
        echo "step 9 needs release $UPGRADE_FROM's commit $commit: git fetch --unshallow (a clone with --depth has no history)" >&2
        exit 1
    fi
    local key
    key=$(printf '%s\n' "$commit" "$(rustc --version)" "$("$PG_CONFIG" --version)" "$PGRX_VERSION" \
        "$(realpath "$PG_CONFIG")" |
        sha256sum | cut -c1-16)
    release_files=$PG_ONCE_WORK/releases/pg_once-$UPGRADE_FROM-$key
    if [ ! -f "$release_files.done" ]; then
        say "9/9 building pg_once $UPGRADE_FROM from its commit ${commit:0:9}"
        local src=$PG_ONCE_WORK/releases/src-$UPGRADE_FROM
        rm -rf "$src" && mkdir -p "$src"
        git -C "$REPO_ROOT" archive "$commit" | tar -x -C "$src"
        # Its own target directory: it shares no artifact with the current tree's build.
        CARGO_TARGET_DIR=$PG_ONCE_WORK/releases/target upgrade_package "$src" "$release_files"
        touch "$release_files.done"
    fi
}

# expect_refusal WHAT OUTPUT: the psql OUTPUT (stderr included) shows pg_once's 55000
# refusal with a hint.
expect_refusal() {
    local what=$1 output=$2
    if ! grep -q "ERROR:  55000" <<<"$output" || ! grep -q "HINT:" <<<"$output"; then
        echo "$what: expected a 55000 error with a hint, got:" >&2
        echo "$output" >&2
        exit 1
    fi
    echo "$what: refused as expected:" >&2
    grep -E "ERROR|HINT" <<<"$output" | sed 's/^/    /' >&2
}

# upgrade_test PORT
upgrade_test() {
    local port=$1
    local root=$PG_ONCE_WORK/upgrade-pg work=$PG_ONCE_WORK/upgrade-files
    rm -rf "$work" && mkdir -p "$work" && chown postgres "$work"
    upgrade_build_release
    say "9/9 packaging the current tree"
    upgrade_package "$REPO_ROOT" "$work/current"
    upgrade_copy_installation "$root"
    upgrade_install "$release_files" "$root"

    (
        PG_BIN=$root$(realpath "$("$PG_CONFIG" --bindir)")
        export PG_ONCE_PG_BIN=$PG_BIN
        local name=upgrade
        psql_() { cluster_psql "$name" "$port" -At "$@"; }
        psql_out() { cluster_psql "$name" "$port" -At -v VERBOSITY=verbose "$@" 2>&1 || true; }
        trap 'pgbouncer_stop upgrade-bouncer; cluster_stop upgrade' EXIT

        say "9/9 pg_once $UPGRADE_FROM on a preloaded server, filled through its own functions"
        cluster_start "$name" "$port" "max_prepared_transactions = 10" \
            "shared_preload_libraries = 'pg_once'" "once.databases = 'postgres, pg_once_missing'"
        installed() { psql_ -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_once'"; }
        expect_installed() {
            [ "$(installed)" = "$1" ] || { echo "expected pg_once $1 installed, found $(installed)" >&2; exit 1; }
        }
        psql_ -q -c "CREATE EXTENSION pg_once"
        expect_installed "$UPGRADE_FROM"
        psql_ -q -f pg_test/upgrade/fill.sql >/dev/null
        local columns
        columns=$(psql_ -c "
            SELECT array_agg(c.relname || '.' || a.attname)
              FROM pg_depend d JOIN pg_class c ON c.oid = d.objid
              JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
             WHERE d.classid = 'pg_class'::regclass AND d.deptype = 'e' AND c.relkind IN ('r', 'S')
               AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_once')")
        snapshot() { psql_ -c "SET snapshot.columns = '$columns'" -f pg_test/upgrade/snapshot.sql; }
        snapshot >"$work/before.txt"
        echo "$(wc -l <"$work/before.txt") rows and sequence values kept before the upgrade" >&2
        # (e) A database whose owner, no superuser, was given schema once after a superuser
        # installed pg_once there (since 0.2.0 the install itself refuses a schema once
        # another role made), and planted an operator int[] < int[] in it that the update's
        # version check would resolve instead of pg_catalog's: the update refuses the
        # schema before anything in it runs (sql/schema.sql's $trust$ block).
        psql_ -q -c "CREATE ROLE up_dbowner" -c "CREATE DATABASE pg_once_planted OWNER up_dbowner" \
            -c "\\c pg_once_planted" -c "CREATE EXTENSION pg_once" \
            -c "ALTER SCHEMA once OWNER TO up_dbowner" -c "SET ROLE up_dbowner" \
            -c "CREATE TABLE once.sprung (ran_as name)" \
            -c "CREATE FUNCTION once.trap(int[], int[]) RETURNS boolean LANGUAGE sql
                    AS 'INSERT INTO once.sprung VALUES (current_user) RETURNING false'" \
            -c "CREATE OPERATOR once.< (LEFTARG = int[], RIGHTARG = int[], FUNCTION = once.trap)" \
            -c "RESET ROLE"

        say "9/9 the new files installed while the server runs the old library"
        upgrade_install "$work/current" "$root"
        expect_refusal "ALTER EXTENSION UPDATE with the $UPGRADE_FROM library loaded" \
            "$(psql_out -c "ALTER EXTENSION pg_once UPDATE")"
        expect_installed "$UPGRADE_FROM"
        snapshot | diff "$work/before.txt" - >&2

        say "9/9 restarted: the new library with the $UPGRADE_FROM SQL"
        pg_server pg_ctl -D "$PG_ONCE_WORK/$name/data" -w -m fast restart \
            -l "$PG_ONCE_WORK/$name/server.log" >/dev/null
        expect_refusal "claim_key before ALTER EXTENSION UPDATE" \
            "$(psql_out -c "SELECT * FROM once.claim_key('up:new')")"
        expect_refusal "once.stats before ALTER EXTENSION UPDATE" \
            "$(psql_out -c "SELECT * FROM once.stats")"
        local i
        for i in $(seq 50); do
            grep -q "the worker reaps nothing until ALTER EXTENSION pg_once UPDATE" \
                "$PG_ONCE_WORK/$name/server.log" && break
            sleep 0.1
        done
        local warned
        warned=$(grep -c "the worker reaps nothing until ALTER EXTENSION pg_once UPDATE" \
            "$PG_ONCE_WORK/$name/server.log" || true)
        if [ "$warned" != 1 ]; then
            echo "the worker should have logged the version mismatch once, logged it $warned times" >&2
            exit 1
        fi

        say "9/9 (e) ALTER EXTENSION pg_once UPDATE into a schema once its database's owner made"
        local planted
        planted=$(psql_out -d pg_once_planted -c "ALTER EXTENSION pg_once UPDATE")
        if ! grep -q "ERROR:  42501: schema once belongs to role up_dbowner" <<<"$planted"; then
            echo "expected the update to refuse schema once (42501), got:" >&2
            echo "$planted" >&2
            exit 1
        fi
        [ "$(psql_ -d pg_once_planted -c "SELECT count(*) FROM once.sprung")" = 0 ] ||
            { echo "the planted operator ran during the update" >&2; exit 1; }
        echo "refused, and the planted operator never ran:" >&2
        grep -E "ERROR|HINT" <<<"$planted" | sed 's/^/    /' >&2
        psql_ -q -c "DROP DATABASE pg_once_planted" -c "DROP ROLE up_dbowner"

        say "9/9 ALTER EXTENSION pg_once UPDATE"
        psql_ -c "ALTER EXTENSION pg_once UPDATE"
        expect_installed "$(psql_ -c "SELECT once_internal.library_version()")"
        echo "pg_once $UPGRADE_FROM -> $(installed)" >&2

        say "9/9 (b) every row and the token sequence kept"
        snapshot | diff "$work/before.txt" - >&2
        say "9/9 (a) the schema equals a fresh install's"
        # With fill.sql's grants, as the current version names the functions: a function the
        # update replaced must have kept what was granted on it.
        psql_ -q -c "CREATE DATABASE pg_once_fresh" -c "\\c pg_once_fresh" -c "CREATE EXTENSION pg_once" \
            -f pg_test/upgrade/grants.sql
        schema() {
            # OIDs, frozen xids, the sequence's bounds (taken from the WAL position at
            # creation) and pg_dump's random \restrict key differ between any two installs;
            # everything else must not.
            "$PG_BIN/pg_dump" -h 127.0.0.1 -p "$port" -U postgres --schema-only --binary-upgrade "$1"
        }
        normalize() {
            grep -v -e '^--' -e 'binary_upgrade_set_next_' -e '^SET ' -e '^SELECT pg_catalog.set_config' \
                    -e '^\\restrict ' -e '^\\unrestrict ' |
                sed -E -e "s/'\{[0-9,]*\}'/'{oids}'/g" -e "s/^WHERE oid = '[0-9]+';/WHERE oid = N;/" \
                    -e 's/(START WITH|MINVALUE) [0-9]+/\1 N/' -e 's/setval\([^)]*\)/setval(N)/' |
                cat -s
        }
        schema pg_once_fresh | normalize >"$work/fresh.sql"
        schema postgres | normalize >"$work/upgraded.sql"
        if ! diff -u "$work/fresh.sql" "$work/upgraded.sql" >"$work/schema.diff"; then
            echo "the upgraded schema differs from a fresh install's ($work/schema.diff):" >&2
            cat "$work/schema.diff" >&2
            exit 1
        fi
        echo "$(grep -c . "$work/fresh.sql") lines of schema, equal" >&2
        psql_ -q -c "DROP DATABASE pg_once_fresh"

        say "9/9 (c) the multi-connection suite on the upgraded database"
        pgbouncer_start upgrade-bouncer $((port + 10)) "$port" 6
        export PG_ONCE_DSN="host=127.0.0.1 port=$port user=postgres dbname=postgres"
        export PG_ONCE_BOUNCER_DSN="host=127.0.0.1 port=$((port + 10)) user=postgres dbname=postgres"
        # Its RECONNECT test alone, after the others, as suite.sh multi runs it.
        reconnects=an_owner_session_keeps_a_pooled_claim_until_its_process_goes
        cargo test -p pg_once_multi --quiet --test protocol --test wakeups --test queue \
            --test pooling --test namespaces --test freshness --test announcements -- --skip "$reconnects"
        cargo test -p pg_once_multi --quiet --test pooling "$reconnects"
        PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data \
            cargo test -p pg_once_multi --quiet --test crash -- --test-threads=1
        PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data PG_ONCE_SERVER_LOG=$PG_ONCE_WORK/$name/server.log \
            cargo test -p pg_once_multi --quiet --test worker -- --test-threads=1
        # Last: it drops and creates the extension again.
        PG_ONCE_DATA_DIR=$PG_ONCE_WORK/$name/data \
            cargo test -p pg_once_multi --quiet --test tokens -- --test-threads=1
    )
}
