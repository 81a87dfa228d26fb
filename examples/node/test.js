// Tests of the Node client against a running server (PG_ONCE_DSN); run by scripts/test.sh.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { OnceClient, OnceFailed } from './once.js';

const DSN = process.env.PG_ONCE_DSN;
const fresh = (name) => `node/${name}/${randomUUID()}`;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function manyCallersOneComputation(protocol) {
  const key = fresh(protocol);
  let computed = 0;
  const clients = await Promise.all(Array.from({ length: 20 }, () => OnceClient.connect(DSN, { protocol })));
  const results = await Promise.all(clients.map((c) => c.get(key, async () => {
    computed += 1;
    await sleep(500);
    return { value: 42 };
  })));
  await Promise.all(clients.map((c) => c.end()));
  assert.equal(computed, 1, 'exactly one caller computes');
  assert.deepEqual(results, Array(20).fill({ value: 42 }));
}

test('many callers, one computation: server-side waiting', () => manyCallersOneComputation('server'));
test('many callers, one computation: LISTEN first', () => manyCallersOneComputation('listen'));

test('a failure is shared, not retried by every caller', async () => {
  const key = fresh('failure');
  let attempts = 0;
  const clients = await Promise.all(Array.from({ length: 10 }, () => OnceClient.connect(DSN)));
  const outcomes = await Promise.allSettled(clients.map((c) => c.get(key, async () => {
    attempts += 1;
    await sleep(300);
    throw new Error('upstream returned 503');
  }, { retryAfter: 30 })));
  await Promise.all(clients.map((c) => c.end()));
  assert.equal(attempts, 1);
  const shared = outcomes.filter((o) => o.status === 'rejected' && o.reason instanceof OnceFailed);
  assert.equal(shared.length, 9);
  assert.match(shared[0].reason.error, /upstream returned 503/);
});

test('a killed caller is taken over', async () => {
  const key = fresh('killed');
  const admin = new pg.Client({ connectionString: DSN });
  await admin.connect();
  const victim = await OnceClient.connect(DSN, { lease: 3 });
  const { rows: [{ pid }] } = await victim.client.query('SELECT pg_backend_pid() AS pid');
  victim.client.on('error', () => {}); // its connection is about to be killed
  let started;
  const begun = new Promise((r) => { started = r; });
  const doomed = victim.get(key, async () => { started(); await sleep(1500); return 'never'; });
  await begun;
  const successor = await OnceClient.connect(DSN);
  await admin.query('SELECT pg_terminate_backend($1)', [pid]);
  const t0 = Date.now();
  assert.equal(await successor.get(key, async () => 'second try'), 'second try');
  assert.ok(Date.now() - t0 < 2000, `took ${Date.now() - t0} ms`);
  await assert.rejects(doomed, 'the killed caller cannot store its result');
  await successor.end();
  await admin.end();
});

test('cached() caches by key', async () => {
  const once = await OnceClient.connect(DSN);
  const prefix = fresh('cached');
  const calls = [];
  const square = once.cached(async (n) => { calls.push(n); return n * n; }, { key: (n) => `${prefix}/${n}`, ttl: 60 });
  assert.deepEqual([await square(3), await square(3), await square(4)], [9, 9, 16]);
  assert.deepEqual(calls, [3, 4]);
  await once.end();
});
