-- A database as pg_once 0.2.0 leaves it after some use, made with 0.2.0's functions only:
-- results with and without a ttl, a failed key waiting for its retry, a running claim,
-- queued jobs in two queues with payloads, a job that exhausted its attempts (a dead
-- letter), attempt history, and tokens drawn for keys since invalidated.
\set ON_ERROR_STOP 1
SELECT once.create_queue('mail', max_attempts => 1, backoff => '1 second');

SELECT once.complete_key('up:done', (once.claim_key('up:done', owner_pid => 0)).token,
                         '{"value": 42}', ttl => NULL);
SELECT once.complete_key('up:ttl', (once.claim_key('up:ttl', owner_pid => 0)).token,
                         '"for a day"', ttl => '1 day');
SELECT once.fail_key('up:failed', (once.claim_key('up:failed', owner_pid => 0)).token,
                     'upstream 503', retry_after => '1 hour');
SELECT (once.claim_key('up:running', lease => '1 day', owner_pid => 0)).outcome;
SELECT once.invalidate_key(k)
  FROM (SELECT 'up:gone:' || i AS k, once.claim_key('up:gone:' || i, owner_pid => 0)
          FROM generate_series(1, 3) AS i) AS claimed;

SELECT once.enqueue_key('job:' || i, jsonb_build_object('n', i), priority => i % 3)
  FROM generate_series(1, 5) AS i;
SELECT once.enqueue_key('mail:1', '{"to": "a@example.com"}', queue => 'mail');
SELECT once.enqueue_key('mail:2', '{"to": "b@example.com"}', queue => 'mail',
                        run_at => now() + interval '1 day');
-- One job claimed and failed: with max_attempts 1 it is a dead letter.
SELECT once.fail_key(c.key, c.token, 'bounced', retry_after => '0')
  FROM once.claim_next('mail', owner_pid => 0) AS c;
-- One job claimed and completed: history.
SELECT once.complete_key(c.key, c.token, '"sent"')
  FROM once.claim_next('default', owner_pid => 0) AS c;

-- A result with a stale window and early refreshes (0.2.0's freshness).
SELECT once.complete_key('up:fresh', (once.claim_key('up:fresh', owner_pid => 0)).token,
                         '"fresh"', ttl => '1 day', stale => '1 hour', beta => 1.0);

-- An application role granted what it uses: the update replaces claim_key (a new
-- signature), and must carry these grants over (upgrade-test.sh gives a fresh install
-- the same grants, pg_test/upgrade/grants.sql, and compares).
CREATE ROLE up_app;
GRANT USAGE ON SCHEMA once TO up_app;
GRANT EXECUTE ON FUNCTION once.claim_key(text, interval, interval, integer, boolean),
                          once.get(text),
                          once.complete_key(text, bigint, jsonb, interval, interval, float8, float8),
                          once.complete_keys(text[], bigint[], jsonb[], interval, interval, float8, float8),
                          once.fail_key(text, bigint, text, interval),
                          once.enqueue_key(text, jsonb, text, integer, timestamptz, boolean, integer),
                          once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer),
                          once.create_queue(text, integer, interval, interval, text)
    TO up_app;
GRANT SELECT ON once.stats TO up_app;
-- Nothing in once_internal is granted to anyone: the update takes this back (a fresh
-- install has none).
GRANT EXECUTE ON FUNCTION once_internal.row_taken(tid) TO up_app;
-- The upgrading role's default privileges give nothing the update creates to anyone
-- (grants.sql sets the same ones after a fresh install, so that both dumps list them).
CREATE ROLE up_intruder;
ALTER DEFAULT PRIVILEGES GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO up_intruder;
ALTER DEFAULT PRIVILEGES GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO up_intruder;
ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON ROUTINES TO up_intruder;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO up_intruder;
