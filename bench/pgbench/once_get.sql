-- A cache hit through once.get: the fresh result alone, from a scalar call.
\set k random(1, 10000)
SELECT once.get('hot:' || :k);
