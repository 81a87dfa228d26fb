-- An application role, as the README grants it, whose keys under 'tenant/' are in a
-- namespace it is a member of the owner of; 10,000 completed keys there.
SET client_min_messages = warning;
CREATE ROLE bench_tenant;
CREATE ROLE bench_app LOGIN IN ROLE bench_tenant;
GRANT USAGE ON SCHEMA once TO bench_app;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA once TO bench_app;
SELECT once.create_namespace('tenant/', 'bench_tenant');
SELECT count(once.complete_key(c.key, c.token, '{"title": "page"}'))
  FROM (SELECT 'tenant/hot:' || i AS key FROM generate_series(1, 10000) i) k,
       LATERAL (SELECT k.key, token FROM once.claim_key(k.key)) c
 WHERE c.token IS NOT NULL;
VACUUM ANALYZE once.entries;
