// Freshness (pg_once 0.2.0) through getOrCompute(..., { stale, beta }): inside a stale
// window every caller gets the old value at once while one caller, in one process,
// refreshes it in a detached promise; a failed refresh keeps the old value served and the
// next caller refreshes; with beta a refresh starts before expiry; end() leaves no refresh
// behind.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import {
  setups, makeClient, closeClient, freshKey, sleep, admin, child,
} from './helpers.js';

// The computations below take COMPUTE_MS; a caller "answered at once" is answered within
// AT_ONCE_MS, far below it (a wait for the computation cannot be that quick).
const COMPUTE_MS = 2000;
const AT_ONCE_MS = 750;
// A refresh that wrongly blocks its caller fails its test rather than hanging the run.
const LIMIT = { timeout: 30_000 };

for (const setup of setups) {
  describe(`freshness (${setup.name})`, () => {
    let a;
    let filler;
    before(async () => {
      a = await admin();
      filler = makeClient(setup);
    });
    after(async () => {
      await closeClient(filler);
      await a.end();
    });

    const entry = async (key) => (await a.query(
      'SELECT state::text, result, error FROM once.entries WHERE key_hash = once.key_hash($1)', [key])).rows[0];
    /** Whether `value` is the key's stored result and no refresh of it is running. */
    const stored = async (key, value) => {
      const row = await entry(key);
      return row?.state === 'done' && JSON.stringify(row.result) === JSON.stringify(value);
    };
    const waitUntil = async (predicate, ms, what) => {
      const deadline = Date.now() + ms;
      while (!(await predicate())) {
        if (Date.now() > deadline) assert.fail(`not within ${ms} ms: ${what}`);
        await sleep(50);
      }
    };
    /** Store `value` with a 0.5 s ttl and a 60 s stale window, then wait out the ttl. */
    const expireIntoStaleWindow = async (key, value = 'v1') => {
      assert.equal(await filler.getOrCompute(key, () => value, { ttl: 0.5, stale: 60 }), value);
      await sleep(700);
    };
    const timed = async (promise) => {
      const started = Date.now();
      const value = await promise;
      return { value, ms: Date.now() - started };
    };

    test('in the stale window every caller gets the old value at once; one background refresh replaces it', LIMIT, async () => {
      const key = freshKey('stale');
      await expireIntoStaleWindow(key);
      const readers = Array.from({ length: 4 }, () => makeClient(setup)); // four "processes"
      try {
        let computed = 0;
        const refresh = async () => {
          computed += 1;
          await sleep(COMPUTE_MS);
          return 'v2';
        };
        const answers = await Promise.all(Array.from({ length: 20 }, (_, i) => timed(
          readers[i % 4].getOrCompute(key, refresh, { ttl: 60, stale: 60 }),
        )));
        assert.deepEqual(answers.map((x) => x.value), Array(20).fill('v1'));
        const slowest = Math.max(...answers.map((x) => x.ms));
        assert.ok(slowest < AT_ONCE_MS, `a caller waited ${slowest} ms for a ${COMPUTE_MS} ms refresh`);
        await waitUntil(() => stored(key, 'v2'), COMPUTE_MS + 5000, 'the refresh stored v2');
        assert.equal(computed, 1);
        assert.equal(await readers[1].getOrCompute(key, () => assert.fail('recomputed'), { ttl: 60, stale: 60 }), 'v2');
      } finally {
        await Promise.all(readers.map((r) => closeClient(r)));
      }
    });

    test('one refresh per window across processes, every caller answered at once', LIMIT, async () => {
      const key = freshKey('stale-procs');
      await expireIntoStaleWindow(key);
      const startAt = Date.now() + 1500; // the children ask together, during the refresh
      const children = Array.from({ length: 3 }, () => child(setup, 'stale', {
        key, callers: 5, computeMs: COMPUTE_MS, startAt,
      }));
      const reports = await Promise.all(children.map((c) => c.next((m) => m.answers, 30_000)));
      assert.deepEqual((await Promise.all(children.map((c) => c.exit))).map((e) => e.code), [0, 0, 0]);
      assert.equal(reports.reduce((sum, r) => sum + r.computed, 0), 1, JSON.stringify(reports.map((r) => r.computed)));
      const answers = reports.flatMap((r) => r.answers);
      assert.equal(answers.length, 15);
      assert.deepEqual(answers.map((x) => x.value), Array(15).fill('v1'));
      const slowest = Math.max(...answers.map((x) => x.ms));
      assert.ok(slowest < AT_ONCE_MS, `a caller waited ${slowest} ms for a ${COMPUTE_MS} ms refresh`);
      const row = await entry(key);
      assert.equal(row.state, 'done');
      assert.deepEqual(Object.keys(row.result), ['by'], 'the refreshing process stored its result before it ended');
    });

    test('a failed refresh keeps the old value served, and the next caller refreshes', LIMIT, async () => {
      const key = freshKey('stale-error');
      await expireIntoStaleWindow(key);
      const errors = [];
      const reader = makeClient(setup, { onError: (err) => errors.push(err) });
      const later = makeClient(setup);
      try {
        let attempts = 0;
        const boom = async () => {
          attempts += 1;
          await sleep(COMPUTE_MS);
          throw new Error('upstream returned 503');
        };
        let answer = await timed(reader.getOrCompute(key, boom, { ttl: 60, stale: 60, retryAfter: 0 }));
        assert.equal(answer.value, 'v1');
        assert.ok(answer.ms < AT_ONCE_MS);
        await waitUntil(async () => (await entry(key)).state !== 'running', 10_000, 'the failed refresh was recorded');
        const row = await entry(key);
        assert.equal(row.result, 'v1');
        assert.match(row.error ?? '', /upstream returned 503/);
        // onError is called once fail_key has answered, which can be after its commit is
        // visible to the query above.
        await waitUntil(() => errors.some((e) => /refreshing .* failed/.test(e.message)), 5_000, 'the failure reaches onError');
        // Still the old value, at once; this caller draws the next refresh, which succeeds.
        answer = await timed(later.getOrCompute(key, async () => { await sleep(COMPUTE_MS); return 'v2'; }, { ttl: 60, stale: 60 }));
        assert.equal(answer.value, 'v1');
        assert.ok(answer.ms < AT_ONCE_MS);
        await waitUntil(() => stored(key, 'v2'), 10_000, 'the second refresh stored v2');
        assert.equal(attempts, 1);
      } finally {
        await closeClient(reader);
        await closeClient(later);
      }
    });

    test('a call without stale or beta waits for the refresh, as before', LIMIT, async () => {
      const key = freshKey('plain-waits');
      await expireIntoStaleWindow(key);
      const refresher = makeClient(setup);
      const plain = makeClient(setup);
      try {
        assert.equal(await refresher.getOrCompute(key, async () => { await sleep(1000); return 'v2'; }, { ttl: 60, stale: 60 }), 'v1');
        // No stale answer for a caller that did not ask for one: it waits for the refresh.
        const answer = await timed(plain.getOrCompute(key, () => assert.fail('computed beside the refresh'), { ttl: 60 }));
        assert.equal(answer.value, 'v2');
        assert.ok(answer.ms > 500, `answered in ${answer.ms} ms`);
      } finally {
        await closeClient(refresher);
        await closeClient(plain);
      }
    });

    test('beta: a refresh starts before expiry, and nobody waits for it', LIMIT, async () => {
      const key = freshKey('beta');
      const client = makeClient(setup);
      try {
        const starts = [];
        const compute = async () => {
          starts.push(Date.now());
          await sleep(COMPUTE_MS); // the delta pg_once measures (claim to completion)
          return starts.length;
        };
        const options = { ttl: 15, beta: 10 };
        assert.equal(await client.getOrCompute(key, compute, options), 1);
        const expiry = Date.now() + options.ttl * 1000;
        // XFetch: a hit at t refreshes with probability exp(-(expiry - t) / (beta * delta)),
        // here at least exp(-15 / 20) = 0.47 a call: dozens of calls leave no room for chance.
        // Stop early enough for the refresh to land before expiry.
        while (starts.length < 2 && Date.now() < expiry - COMPUTE_MS - 1500) {
          const answer = await timed(client.getOrCompute(key, compute, options));
          assert.equal(answer.value, 1);
          assert.ok(answer.ms < AT_ONCE_MS, `a caller waited ${answer.ms} ms for the early refresh`);
          await sleep(50);
        }
        assert.equal(starts.length, 2, 'no early refresh before expiry');
        assert.ok(starts[1] < expiry);
        await waitUntil(async () => (await client.getOrCompute(key, compute, options)) === 2,
          expiry - Date.now(), 'the early refresh replaced the value before expiry');
      } finally {
        await closeClient(client);
      }
    });

    test('end() waits for a running refresh to store its result', LIMIT, async () => {
      const key = freshKey('end-waits');
      await expireIntoStaleWindow(key);
      const client = makeClient(setup);
      assert.equal(await client.getOrCompute(key, async () => { await sleep(800); return 'v2'; }, { ttl: 60, stale: 60 }), 'v1');
      const { ms } = await timed(closeClient(client));
      assert.ok(ms < 5000);
      assert.ok(await stored(key, 'v2'));
    });

    test('end() gives back the claim of a refresh still running after refreshTimeout', LIMIT, async () => {
      const key = freshKey('end-gives-back');
      await expireIntoStaleWindow(key);
      const client = makeClient(setup);
      let finish;
      const hang = () => new Promise((resolve) => { finish = resolve; });
      assert.equal(await client.getOrCompute(key, hang, { ttl: 60, stale: 60 }), 'v1');
      assert.equal((await entry(key)).state, 'running');
      const { ms } = await timed(client.end({ refreshTimeout: 0.5 }));
      assert.ok(ms < 2500, `end() took ${ms} ms`);
      await client.pool.end();
      // Released by end() itself, not ended later because the listener connection closed.
      const { rows: [row] } = await a.query(
        'SELECT state::text, last_outcome FROM once.entries WHERE key_hash = once.key_hash($1)', [key]);
      assert.notEqual(row.state, 'running');
      assert.equal(row.last_outcome, 'released');
      // Given back: the next caller draws the refresh at once, not after a lease.
      const other = makeClient(setup);
      try {
        assert.equal(await other.getOrCompute(key, () => 'v2', { ttl: 60, stale: 60 }), 'v1');
        await waitUntil(() => stored(key, 'v2'), 5000, "the next caller's refresh stored v2");
      } finally {
        await closeClient(other);
      }
      finish('too late'); // the abandoned computation ends and stores nothing
      await sleep(300);
      assert.ok(await stored(key, 'v2'));
    });

    test('cached() passes the freshness options', LIMIT, async () => {
      const key = freshKey('cached-stale');
      let computed = 0;
      const page = filler.cached(async () => {
        computed += 1;
        await sleep(COMPUTE_MS * (computed - 1));
        return computed;
      }, { key: () => key, ttl: 0.5, stale: 60 });
      assert.equal(await page(), 1);
      await sleep(700);
      const answer = await timed(page());
      assert.equal(answer.value, 1); // stale, at once; the refresh runs in the background
      assert.ok(answer.ms < AT_ONCE_MS, `answered after ${answer.ms} ms`);
      await waitUntil(async () => (await page()) === 2, COMPUTE_MS + 8000, 'the background refresh replaced the value');
    });

    test('freshness options are checked before anything is claimed', LIMIT, async () => {
      const key = freshKey('bad-freshness');
      await assert.rejects(filler.getOrCompute(key, () => 1, { stale: 60 }), /need a ttl/);
      await assert.rejects(filler.getOrCompute(key, () => 1, { ttl: 10, beta: 1000 }), /beta must be/);
      await assert.rejects(filler.getOrCompute(key, () => 1, { ttl: 10, jitter: 1 }), /jitter must be/);
      await assert.rejects(filler.getOrCompute(key, () => 1, { ttl: 10, stale: -1 }), /stale must be/);
      assert.throws(() => filler.cached(() => 1, { name: key, beta: 1 }), /need a ttl/);
      assert.equal(await entry(key), undefined);
      // jitter alone reaches complete_key: each key's ttl is shortened by up to half, drawn
      // per key (all 8 left above 95 s by chance: 0.1^8).
      const keys = Array.from({ length: 8 }, (_, i) => `${key}/${i}`);
      for (const k of keys) await filler.getOrCompute(k, () => 1, { ttl: 100, jitter: 0.5 });
      const { rows } = await a.query(
        `SELECT extract(epoch FROM expires_at - now())::float8 AS left FROM once.entries
          WHERE key_hash = ANY (SELECT once.key_hash(k) FROM unnest($1::text[]) k)`, [keys]);
      const left = rows.map((r) => r.left);
      assert.equal(left.length, 8);
      assert.ok(left.every((x) => x > 45 && x <= 100), `expire in ${left} s`);
      assert.ok(Math.min(...left) < 95, `expire in ${left} s`);
    });
  });
}
