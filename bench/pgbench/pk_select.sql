-- The physical limit of a hit: a primary-key SELECT of the cached row.
\set k random(1, 10000)
SELECT status, result FROM url_scans WHERE url = 'hot:' || :k;
