-- The transcripts of docs/sql-reference.md. scripts/check-docs.py checks that every psql
-- block of that page appears verbatim in this test's expected output, so the page cannot
-- drift from what the server does.
CREATE EXTENSION pg_once;
SET application_name = 'docs';
SET intervalstyle = postgres;
-- claim_key: a cold key is claimed
SELECT outcome, token > 0 AS has_token, attempts FROM once.claim_key('https://example.com/a');
-- claim_key: the same session asking again waits for itself
SELECT outcome FROM once.claim_key('https://example.com/a');
-- heartbeat_key
SELECT once.heartbeat_key('https://example.com/a', token, '1 minute') > now() AS extended
  FROM once.entries WHERE key = 'https://example.com/a';
-- complete_key
SELECT once.complete_key('https://example.com/a', token, '{"title": "A"}', ttl => '1 hour')
  FROM once.entries WHERE key = 'https://example.com/a';
-- claim_key: a hit
SELECT outcome, result, expires_at > now() AS expires FROM once.claim_key('https://example.com/a');
-- get: the hit alone, and NULL for a key claim_key would not answer hit
SELECT once.get('https://example.com/a') AS hit, once.get('https://example.com/none') AS absent;
-- complete_key: a stale token changes nothing
SELECT once.complete_key('https://example.com/a', 1, '{"title": "stale"}');
-- fail_key
SELECT once.fail_key('https://example.com/b', token, 'upstream returned 503', retry_after => '5 minutes')
  FROM once.claim_key('https://example.com/b');
SELECT outcome, error, retry_at > now() AS later FROM once.claim_key('https://example.com/b');
-- release_key
SELECT once.release_key('https://example.com/c', token) FROM once.claim_key('https://example.com/c');
SELECT outcome FROM once.claim_key('https://example.com/c');
-- invalidate_key
SELECT once.invalidate_key('https://example.com/a'), once.invalidate_key('https://example.com/a');
-- bad input
SELECT * FROM once.claim_key('');
SELECT * FROM once.claim_key('k', lease => '0');
SELECT once.complete_key('k', NULL, '{}');
SELECT * FROM once.claim_key('k', owner_pid => -1);
-- reap_stale
SELECT * FROM once.reap_stale();
-- queue mode
SELECT once.create_queue('thumbnails', max_attempts => 3, backoff => '10 seconds');
SELECT once.enqueue_key('img/1', '{"w": 128}', 'thumbnails');
SELECT once.enqueue_key('img/1', '{"w": 128}', 'thumbnails');
SELECT key, payload, attempt FROM once.claim_next('thumbnails', worker => 'worker-1');
SELECT count(*) AS claimed FROM once.claim_next('thumbnails', wait => '100 milliseconds');
SELECT key FROM once.complete_keys(ARRAY['img/1'], ARRAY[(SELECT token FROM once.entries WHERE key = 'img/1')],
                                   ARRAY['{"url": "s3://thumbs/1"}']::jsonb[]);
SELECT key, worker, outcome FROM once.attempts;
SELECT queue, depth, due, running, dead, completed_last_minute FROM once.queue_stats ORDER BY queue;
SELECT once.invalidate_keys(queue => 'thumbnails');
SELECT once.drop_queue('thumbnails');
SELECT once.enqueue_key('img/2', queue => 'nope');
SELECT once.enqueue_key('img/1');
SELECT * FROM once.enqueue_keys(ARRAY['img/1', 'img/2', 'img/3'],
                                ARRAY['{"w": 128}', '{"w": 64}', NULL]::jsonb[]);
SELECT * FROM once.enqueue_keys(ARRAY['img/4', 'img/4']);
SELECT once.invalidate_keys(queue => 'default') AS forgotten;
-- stats
SELECT queued, running, done, failed FROM once.stats;
-- freshness: a result past its ttl, in its stale window
SELECT once.complete_key('https://example.com/d', token, '{"v": 1}', ttl => '1 millisecond', stale => '1 hour')
  FROM once.claim_key('https://example.com/d');
SELECT true AS expired FROM pg_sleep(0.01);
SELECT outcome, result, token > 0 AS has_token FROM once.claim_key('https://example.com/d', serve_stale => true);
SELECT outcome, result FROM once.claim_key('https://example.com/d', wait => '10 seconds', serve_stale => true);
SELECT outcome, result FROM once.claim_key('https://example.com/d');
-- refresh_key during the run
SELECT once.refresh_key('https://example.com/d', stale => '1 minute');
-- cached
SELECT once.cached('report:superusers', 'SELECT rolname FROM pg_roles WHERE rolsuper ORDER BY 1', ttl => '5 minutes');
-- fingerprints
SELECT once.complete_key('order:7f3a', token, '{"status": 201, "order": 42}')
  FROM once.claim_key('order:7f3a', fingerprint => sha256('POST /orders {"sku": 1}'));
SELECT outcome, result FROM once.claim_key('order:7f3a', fingerprint => sha256('POST /orders {"sku": 1}'));
SELECT outcome, result FROM once.claim_key('order:7f3a', fingerprint => sha256('POST /orders {"sku": 2}'));
SELECT outcome FROM once.claim_key('order:7f3a', fingerprint => convert_to(repeat('POST /orders {"sku": 2} ', 3), 'UTF8'));
DROP EXTENSION pg_once;
