// A claim_key whose answer is on its way when its callers leave (docs/clients.md, X2, R2,
// N6), in the cases the conformance scenarios (cancelled.json) leave to each client: callers
// coalesced on one flight (C1, X1), the claim() of the idempotency middleware, and end().
// The pool goes through the conformance runner's proxy, which holds the server's answers.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import {
  DSN, makeClient, closeClient, freshKey, sleep, admin,
} from './helpers.js';
import { startProxy, throughProxy } from './proxy.js';

const proxied = DSN && throughProxy(DSN);

describe('a claim_key on its way', { skip: !proxied && 'PG_ONCE_DSN is not set (or not a postgresql:// URL of one host)' }, () => {
  let sql;
  let proxy;
  let client;
  before(async () => {
    sql = await admin();
    proxy = await startProxy(proxied.target);
    client = makeClient({ poolDsn: proxied.dsnFor(proxy), listenDsn: DSN }, { poolSize: 2 });
    await client.ready(); // its pool holds connections through the proxy before it pauses
  });
  after(async () => {
    proxy.resume();
    await closeClient(client);
    await proxy.close();
    await sql.end();
  });

  const stateOf = async (key) => (await sql.query('SELECT state::text FROM once.entries WHERE key = $1', [key])).rows[0]?.state ?? null;
  /** Until `key`'s state is `state` (a claim reached the server, say), up to 10 s. */
  const untilState = async (key, state) => {
    const deadline = Date.now() + 10_000;
    while ((await stateOf(key)) !== state && Date.now() < deadline) await sleep(20);
    assert.equal(await stateOf(key), state, `the state of ${key}`);
  };
  /** Until `key`'s claim, made for a caller that left, is given back, up to 5 s. */
  const untilReleased = async (key) => {
    const deadline = Date.now() + 5000;
    while ((await stateOf(key)) === 'running' && Date.now() < deadline) await sleep(20);
    assert.notEqual(await stateOf(key), 'running', 'the claim made for nobody was released');
  };

  test('one of two coalesced callers cancelled: the claim and its computation go on for the other', async () => {
    const key = freshKey('late-coalesced');
    let computed = 0;
    const compute = async () => { computed += 1; return 'for the one still here'; };
    proxy.pause();
    try {
      const leaving = new AbortController();
      const first = client.getOrCompute(key, compute, { signal: leaving.signal, lease: 60 });
      const second = client.getOrCompute(key, compute, { lease: 60 });
      await untilState(key, 'running');
      leaving.abort(new Error('the first caller leaves'));
      await assert.rejects(first, /the first caller leaves/);
      proxy.resume();
      assert.equal(await second, 'for the one still here');
    } finally {
      proxy.resume();
    }
    assert.equal(computed, 1);
    assert.equal(client.pool.claims.get(key), 1, 'the two callers shared one claim_key');
    assert.equal(await stateOf(key), 'done');
  });

  test('claim() whose wait runs out with its answer held: Timeout at its wait, the claim given back', async () => {
    const key = freshKey('late-claim');
    proxy.pause();
    try {
      const started = Date.now();
      const asked = client.claim(key, { lease: 60, wait: 0.5 });
      await untilState(key, 'running');
      await assert.rejects(asked, (err) => err.kind === 'Timeout');
      assert.ok(Date.now() - started < 2000, `took ${Date.now() - started} ms for a wait of 0.5 s`);
    } finally {
      proxy.resume();
    }
    // Once the answer is through, its claim goes back: the key is nobody's.
    await untilReleased(key);
  });

  // Bounded, so that a client that waits for the held answer fails here rather than hangs.
  test('claim() with wait 0 and its answer held: Timeout after connectTimeout, the claim given back', { timeout: 20_000 }, async () => {
    // No wait to bound the answer by: R2's budget of every other statement bounds it.
    const quick = makeClient({ poolDsn: proxied.dsnFor(proxy), listenDsn: DSN }, { poolSize: 1, connectTimeout: 1 });
    await quick.ready();
    const key = freshKey('late-wait-0');
    proxy.pause();
    try {
      const started = Date.now();
      const asked = quick.claim(key, { lease: 60, wait: 0 });
      await untilState(key, 'running');
      await assert.rejects(asked, (err) => err.kind === 'Timeout');
      const took = Date.now() - started;
      assert.ok(took >= 900 && took < 5000, `took ${took} ms for a connectTimeout of 1 s`);
    } finally {
      proxy.resume();
    }
    await untilReleased(key);
    await closeClient(quick);
  });

  test('end() waits for a late answer and gives back the claim it made', async () => {
    // listen: false, so the claim is the lease's alone: ending the LISTEN connection, which
    // ends the claims it owns, cannot give it back in the client's stead.
    const ending = makeClient({ poolDsn: proxied.dsnFor(proxy), listenDsn: DSN }, { poolSize: 1, listen: false });
    await ending.ready();
    const key = freshKey('late-end');
    proxy.pause();
    let ended;
    try {
      const cancel = new AbortController();
      const call = ending.getOrCompute(key, () => assert.fail('computed for nobody'), { signal: cancel.signal, lease: 60 });
      await untilState(key, 'running');
      cancel.abort(new Error('gone'));
      await assert.rejects(call, /gone/);
      // Ending while the answer is still held: the pool must stay open for its release.
      ended = closeClient(ending);
    } finally {
      proxy.resume();
    }
    await ended;
    assert.notEqual(await stateOf(key), 'running', 'released before end() returned');
  });
});
