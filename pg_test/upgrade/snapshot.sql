-- What an upgrade must keep: every row of every table pg_once keeps and the token
-- sequence, one line each, in a stable order. Rows are shown with the columns listed in
-- psql variable :columns (a text[] literal of table.column: those that existed before
-- the upgrade, sequences' included), so that columns, tables and sequences an upgrade
-- adds do not count as changes. Tables and the
-- sequence are found as the extension's members, wherever their schema.
\set ON_ERROR_STOP 1
\pset format unaligned
\pset tuples_only on
CREATE TEMP TABLE snapshot_lines (line text);
DO $$
DECLARE
    member record;
    kept text[] := current_setting('snapshot.columns')::text[];
    sums text;
BEGIN
    FOR member IN
        SELECT c.oid::regclass AS rel, c.relname, c.relkind
          FROM pg_depend d JOIN pg_class c ON c.oid = d.objid
         WHERE d.classid = 'pg_class'::regclass AND d.deptype = 'e'
           AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_once')
           AND c.relkind IN ('r', 'S')
    LOOP
        -- A table or sequence the upgrade adds has none of the columns kept: nothing of
        -- it to keep.
        CONTINUE WHEN NOT EXISTS (SELECT FROM unnest(kept) k WHERE k LIKE member.relname || '.%');
        IF member.relname = 'key_counts' THEN
            -- Counts are kept per backend slot, and reap_stale, which the worker runs every
            -- second, folds them into slot -1 at any moment: compare their sums per
            -- namespace, which folding keeps (a fold between two snapshots failed a run).
            SELECT string_agg(format('%L, sum(%I)', split_part(k, '.', 2), split_part(k, '.', 2)), ', ')
              INTO sums
              FROM unnest(kept) k
             WHERE k LIKE 'key_counts.%' AND k NOT IN ('key_counts.slot', 'key_counts.namespace');
            EXECUTE format(
                'INSERT INTO snapshot_lines
                 SELECT ''key_counts '' || jsonb_build_object(''namespace'', namespace, %s)::text
                   FROM %s GROUP BY namespace',
                sums, member.rel);
        ELSIF member.relkind = 'S' THEN
            EXECUTE format('INSERT INTO snapshot_lines SELECT %L || '' '' || last_value || '' '' || is_called FROM %s',
                           member.relname, member.rel);
        ELSE
            EXECUTE format(
                'INSERT INTO snapshot_lines
                 SELECT %L || '' '' || (SELECT jsonb_object_agg(key, value) FROM jsonb_each(to_jsonb(t))
                                         WHERE %L || ''.'' || key = ANY (%L))::text
                   FROM %s AS t',
                member.relname, member.relname, kept, member.rel);
        END IF;
    END LOOP;
END
$$;
SELECT line FROM snapshot_lines ORDER BY line;
