-- A cache hit through pg_once: one claim_key call returning the cached result.
\set k random(1, 10000)
SELECT outcome, result FROM once.claim_key('hot:' || :k);
