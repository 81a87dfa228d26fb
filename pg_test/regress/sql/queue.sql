-- Queue mode as a psql user sees it: a queue, workers, retries, a dead letter, history.
CREATE EXTENSION pg_once;
SELECT once.create_queue('thumbnails', max_attempts => 2, backoff => '1 minute');
SELECT once.enqueue_key('img/' || i, jsonb_build_object('size', i * 100), 'thumbnails',
                        priority => 3 - i)
  FROM generate_series(1, 3) i;
SELECT once.enqueue_key('img/1', queue => 'thumbnails');   -- already queued
SELECT queue, depth, due, running, dead FROM once.queue_stats ORDER BY queue;

-- Two workers: smaller priority first; never the same key twice.
SELECT key, payload, attempt FROM once.claim_next('thumbnails', worker => 'w1', n => 2) ORDER BY key;
SELECT key, payload, attempt FROM once.claim_next('thumbnails', worker => 'w2', n => 2) ORDER BY key;
SELECT key, token AS t2 FROM once.entries WHERE key = 'img/2' \gset
SELECT key, token AS t3 FROM once.entries WHERE key = 'img/3' \gset
SELECT key, token AS t1 FROM once.entries WHERE key = 'img/1' \gset

SELECT once.complete_key('img/3', :t3, '{"url": "s3://thumbs/3"}');
-- img/2 fails: back in the queue a minute (with jitter: 30 to 60 s) later.
SELECT once.fail_key('img/2', :t2, 'decoder crashed');
SELECT key, state, errors, run_at - clock_timestamp() BETWEEN '29 s' AND '60 s' AS backs_off
  FROM once.entries WHERE key = 'img/2';
-- Its second and last attempt fails too: a dead letter.
UPDATE once.entries SET run_at = clock_timestamp() WHERE key = 'img/2';
SELECT token AS t2 FROM once.claim_next('thumbnails', worker => 'w3') \gset
SELECT once.fail_key('img/2', :t2, 'decoder crashed again');
SELECT key, attempts, errors, error FROM once.dead_letters;
SELECT outcome, error FROM once.claim_key('img/2');

-- A batch of completions, one of them with a lost claim.
SELECT key FROM once.complete_keys(ARRAY['img/1', 'img/2'], ARRAY[:t1, :t2],
                                   ARRAY['{"url": "s3://thumbs/1"}', '{}']::jsonb[]);
SELECT key, worker, outcome, error FROM once.attempts ORDER BY finished_at, key;

-- Refresh: the old result is served until the new one lands.
SELECT once.enqueue_key('img/3', queue => 'thumbnails', refresh => true);
SELECT outcome, result FROM once.claim_key('img/3');

-- A batch: each key answered as enqueue_key would, in the order given.
SELECT * FROM once.enqueue_keys(ARRAY['img/3', 'img/4', 'img/1'],
                                ARRAY[NULL, '{"size": 400}', NULL]::jsonb[], 'thumbnails');
SELECT key, state, payload FROM once.entries WHERE key IN ('img/1', 'img/3', 'img/4') ORDER BY key;

-- Bad input.
SELECT once.enqueue_key('x', queue => 'nope');
SELECT * FROM once.enqueue_keys(ARRAY['x', 'y'], ARRAY['{}']::jsonb[], 'thumbnails');
SELECT once.claim_next('thumbnails', n => 0);
SELECT once.invalidate_keys();
SELECT once.drop_queue('thumbnails');
SELECT once.create_queue('no spaces please');

SELECT once.invalidate_keys(queue => 'thumbnails');
SELECT once.drop_queue('thumbnails');
SELECT name FROM once.queues;
DROP EXTENSION pg_once;
