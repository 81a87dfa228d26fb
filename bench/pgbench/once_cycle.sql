-- One compute cycle with pg_once on a fresh key: claim, complete.
\set k random(1, 4000000000000)
SELECT coalesce(token, 1) AS token FROM once.claim_key('cycle:' || :client_id || ':' || :k) \gset
SELECT once.complete_key('cycle:' || :client_id || ':' || :k, :token, '{"title": "page"}');
