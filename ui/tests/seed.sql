-- Keys in every state for the dashboard's browser tests (ui/tests/test_browser.py), run
-- as a superuser in a fresh database with pg_once (it creates roles: run it once). Claims are lease-only (owner_pid => 0) so
-- that they outlive this psql session. Two tenants: ui_tenant_a owns namespace
-- 'ui-tenant-a/', ui_tenant_b is outside it; both have the README's grants.
CREATE ROLE ui_tenant_a LOGIN;
CREATE ROLE ui_tenant_b LOGIN;
GRANT USAGE ON SCHEMA once TO ui_tenant_a, ui_tenant_b;
GRANT EXECUTE ON ALL ROUTINES IN SCHEMA once TO ui_tenant_a, ui_tenant_b;
GRANT SELECT ON once.stats, once.queue_stats, once.dead_letters, once.keys TO ui_tenant_a, ui_tenant_b;
SELECT once.create_namespace('ui-tenant-a/', 'ui_tenant_a');

-- done
SELECT count(once.complete_key(k, (once.claim_key(k)).token, jsonb_build_object('n', i), ttl => '1 day'))
  FROM generate_series(1, 12) i, format('ui/site/page/%s', i) k;
-- running (one to complete during the test, live)
SELECT outcome FROM once.claim_key('ui/site/slow/report', lease => '1 hour', owner_pid => 0);
SELECT outcome FROM once.claim_key('ui/live/one', lease => '1 hour', owner_pid => 0);
-- failed (a cached key: retried after an hour)
SELECT once.fail_key('ui/site/broken', (once.claim_key('ui/site/broken', owner_pid => 0)).token,
                     'upstream returned 503', retry_after => '1 hour');
-- queued
SELECT once.create_queue('ui-emails');
SELECT once.enqueue_key(format('ui/email/%s', i), jsonb_build_object('to', i), 'ui-emails')
  FROM generate_series(1, 5) i;
-- dead letters in a shared queue: one attempt each, failed
SELECT once.create_queue('ui-fragile', max_attempts => 1);
SELECT once.enqueue_key('ui/job/dead/1', '{"x": 1}', 'ui-fragile');
SELECT once.enqueue_key('ui/job/dead/2', '{"x": 2}', 'ui-fragile');
SELECT once.fail_key(key, token, 'division by zero') FROM once.claim_next('ui-fragile', owner_pid => 0, n => 2);
-- the tenant's keys: a dead letter in its own queue, a result, a running key
SET ROLE ui_tenant_a;
SELECT once.create_queue('ui-tenant-a-jobs', max_attempts => 1, namespace => 'ui-tenant-a/');
SELECT once.enqueue_key('ui-tenant-a/secret/1', '{"patient": 7}', 'ui-tenant-a-jobs');
SELECT once.fail_key(key, token, 'tenant a failure') FROM once.claim_next('ui-tenant-a-jobs', owner_pid => 0);
SELECT once.complete_key('ui-tenant-a/result', (once.claim_key('ui-tenant-a/result')).token, '{}');
SELECT outcome FROM once.claim_key('ui-tenant-a/live', lease => '1 hour', owner_pid => 0);
RESET ROLE;
