// The queue worker loop: exactly once per job, retries, stop() and signals.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { setups, makeClient, closeClient, sleep, admin, child } from './helpers.js';

async function waitFor(pred, ms, what) {
  const deadline = Date.now() + ms;
  while (!(await pred())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

for (const setup of setups) {
  describe(`worker (${setup.name})`, () => {
    let db;
    let queue;
    before(async () => {
      db = await admin();
    });
    after(() => db.end());

    async function newQueue(jobs) {
      queue = `node-${randomUUID().slice(0, 8)}`;
      await db.query("SELECT once.create_queue($1, max_attempts => 3, backoff => '50 milliseconds', max_backoff => '100 milliseconds')", [queue]);
      const keys = Array.from({ length: jobs }, (_, i) => `${queue}/job/${i}`);
      for (const [i, key] of keys.entries()) await db.query('SELECT once.enqueue_key($1, $2, $3)', [key, { i }, queue]);
      return keys;
    }

    async function dropQueue() {
      await db.query('SELECT once.invalidate_keys(queue => $1)', [queue]);
      await db.query('SELECT once.drop_queue($1)', [queue]);
    }

    test('two workers process every job exactly once; a failing job is retried; stop() stops them', async () => {
      const keys = await newQueue(40);
      const clients = [makeClient(setup), makeClient(setup)];
      const handled = new Map();
      const completed = new Set();
      const handler = async (job) => {
        handled.set(job.key, (handled.get(job.key) ?? 0) + 1);
        await sleep(10 + Math.random() * 30);
        if (job.payload.i === 7 && job.attempt === 1) throw new Error('flaky');
        completed.add(job.key);
        return { double: job.payload.i * 2, attempt: job.attempt };
      };
      try {
        const workers = clients.map((c) => c.work(queue, handler, { concurrency: 4, idleWait: 0.3, handleSignals: false }));
        await waitFor(() => completed.size === 40, 15_000, 'all 40 jobs');
        const stats = await Promise.all(workers.map((w) => w.stop()));
        assert.equal(stats.reduce((n, s) => n + s.completed, 0), 40);
        assert.equal(stats.reduce((n, s) => n + s.failed, 0), 1);
        assert.ok(stats.every((s) => s.completed > 0), 'both workers took jobs');
        for (const key of keys) assert.equal(handled.get(key), key.endsWith('/7') ? 2 : 1, key);
        const { rows } = await db.query(
          'SELECT c.outcome, c.result FROM unnest($1::text[]) k, once.claim_key(k) c', [keys]);
        assert.ok(rows.every((r) => r.outcome === 'hit'));
        assert.deepEqual(rows.map((r) => r.result.double), keys.map((_, i) => i * 2));
        // Stopped: a new job stays queued.
        await db.query('SELECT once.enqueue_key($1, NULL, $2)', [`${queue}/late`, queue]);
        await sleep(500);
        assert.equal(handled.has(`${queue}/late`), false);
      } finally {
        await Promise.all(clients.map(closeClient));
        await dropQueue();
      }
    });

    test('stop() releases a job still running after its timeout, so it is due again at once', async () => {
      const [key] = await newQueue(1);
      const client = makeClient(setup);
      try {
        let aborted = false;
        const worker = client.work(queue, (job) => new Promise((resolve) => {
          job.signal.addEventListener('abort', () => { aborted = true; resolve('late'); });
        }), { handleSignals: false, idleWait: 0.2 });
        await waitFor(async () => (await db.query(
          "SELECT count(*)::int AS n FROM once.entries WHERE queue = $1 AND state = 'running'", [queue])).rows[0].n === 1,
        5000, 'the job to be claimed');
        const stats = await worker.stop({ timeout: 0.3 });
        assert.equal(stats.released, 1);
        assert.equal(stats.completed, 0);
        assert.ok(aborted, 'the handler was told to abort');
        const { rows } = await db.query('SELECT key, attempt FROM once.claim_next($1)', [queue]);
        assert.deepEqual(rows.map((r) => r.key), [key], 'released: due again at once');
      } finally {
        await closeClient(client);
        await dropQueue();
      }
    });

    test('SIGTERM: the worker process finishes the job in hand, takes no more, and exits 0', async () => {
      const keys = await newQueue(3);
      const proc = child(setup, 'worker', { queue, jobMs: 800, concurrency: 1 });
      try {
        const { started } = await proc.next((m) => m.started);
        proc.proc.kill('SIGTERM');
        const stopped = await proc.next((m) => m.stopped, 5000);
        const { code } = await proc.exit;
        assert.equal(code, 0);
        assert.deepEqual(stopped.stopped, { completed: 1, failed: 0, released: 0, lost: 0 });
        assert.ok(proc.messages.some((m) => m.finished === started));
        const { rows } = await db.query(
          'SELECT k, c.outcome FROM unnest($1::text[]) k, once.claim_key(k, wait => \'0\') c', [keys]);
        assert.deepEqual(rows.filter((r) => r.outcome === 'hit').map((r) => r.k), [started]);
      } finally {
        proc.proc.kill('SIGKILL');
        await dropQueue();
      }
    });

    test('claim_next failing for a reason retrying cannot cure (no such queue) stops the worker with that error', { timeout: 10_000 }, async () => {
      const client = makeClient(setup);
      try {
        const worker = client.work(`node-missing-${randomUUID().slice(0, 8)}`, () => 1, { handleSignals: false });
        const started = Date.now();
        await assert.rejects(worker.done, (err) => err.cause?.code === '42704');
        assert.ok(Date.now() - started < 3000, 'not retried every second forever');
      } finally {
        await closeClient(client);
      }
    });
  });
}
