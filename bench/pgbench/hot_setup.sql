-- 10,000 completed keys, in both the baseline table and pg_once.
INSERT INTO url_scans (url, status, result)
SELECT 'hot:' || i, 'completed', '{"title": "page"}' FROM generate_series(1, 10000) i
ON CONFLICT DO NOTHING;
SELECT count(once.complete_key(c.key, c.token, '{"title": "page"}'))
  FROM (SELECT 'hot:' || i AS key FROM generate_series(1, 10000) i) k,
       LATERAL (SELECT k.key, token FROM once.claim_key(k.key)) c
 WHERE c.token IS NOT NULL;
VACUUM ANALYZE url_scans;
VACUUM ANALYZE once.entries;
