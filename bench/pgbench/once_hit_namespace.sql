-- A cache hit on a key inside a namespace: claim_key also checks that the caller is a
-- member of the namespace's owner. (No ':' before a name inside a literal: pgbench would
-- take ':name' for one of its variables.)
\set k random(1, 10000)
SELECT outcome, result FROM once.claim_key('tenant/hot:' || :k);
