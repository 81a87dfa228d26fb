// getOrCompute and cached() in one process, against a real server, in every setup.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import {
  setups, makeClient, closeClient, countingPool, freshKey, sleep, announced, admin, DSN,
} from './helpers.js';
import {
  OnceClient, OnceFailed, OnceTimeout, OnceError, NotSerializable,
} from '../src/index.mjs';
import { Listener, notifiedNames } from '../src/listener.cjs';

for (const setup of setups) {
  describe(`cache (${setup.name})`, () => {
    let client;
    before(async () => {
      client = makeClient(setup);
      await client.ready();
    });
    after(() => closeClient(client));

    test('concurrent calls for one key in one process: one claim_key, one computation, every caller answered', async () => {
      const key = freshKey('coalesce');
      let computed = 0;
      const results = await Promise.all(Array.from({ length: 30 }, () => client.getOrCompute(key, async () => {
        computed += 1;
        await sleep(300);
        return { value: 42 };
      })));
      assert.equal(computed, 1);
      assert.equal(client.pool.claims.get(key), 1, 'the 30 calls share one claim_key');
      assert.deepEqual(results, Array(30).fill({ value: 42 }));
      // Later calls are hits, each with one claim_key of its own.
      assert.deepEqual(await client.getOrCompute(key, () => assert.fail('recomputed')), { value: 42 });
      assert.equal(client.pool.claims.get(key), 2);
    });

    test('claims are owned by the listener connection (owner_pid), or by the lease alone with listen: false', async () => {
      const polling = makeClient(setup, { listen: false });
      const a = await admin();
      try {
        const owners = {};
        for (const [name, c] of [['listening', client], ['polling', polling]]) {
          const key = freshKey(name);
          await c.getOrCompute(key, async () => {
            const { rows: [row] } = await a.query('SELECT owner_pid, lease_only FROM once.entries WHERE key = $1', [key]);
            owners[name] = row;
            return 1;
          });
        }
        assert.deepEqual(owners.listening, { owner_pid: client.ownerPid, lease_only: false });
        assert.equal(owners.polling.lease_only, true);
      } finally {
        await a.end();
        await closeClient(polling);
      }
    });

    test('no statement opens a transaction or names a prepared statement', () => {
      assert.ok(client.pool.statements.length > 0);
      for (const sql of client.pool.statements) assert.doesNotMatch(sql, /\b(BEGIN|START TRANSACTION|PREPARE)\b/i);
    });

    test('several clients (as several processes) on 5 keys: each key computed once, all answered', async () => {
      const clients = Array.from({ length: 3 }, () => makeClient(setup));
      try {
        const keys = Array.from({ length: 5 }, (_, i) => freshKey(`multi${i}`));
        const computed = new Map();
        const results = await Promise.all(clients.flatMap((c, ci) => Array.from({ length: 10 }, (_, n) => {
          const key = keys[(ci + n) % keys.length];
          return c.getOrCompute(key, async () => {
            computed.set(key, (computed.get(key) ?? 0) + 1);
            await sleep(300);
            return key.toUpperCase();
          }).then((r) => [key, r]);
        })));
        assert.equal(results.length, 30);
        for (const [key, r] of results) assert.equal(r, key.toUpperCase());
        for (const key of keys) assert.equal(computed.get(key), 1, `${key} computed once`);
      } finally {
        await Promise.all(clients.map(closeClient));
      }
    });

    test('40 callers sharing a pg.Pool of 4 are answered promptly: waiters hold no connection', async () => {
      // 40 clients (20 listening, 20 polling) share one pool of 4. The owner's lease is
      // 1 s, so its heartbeats must get a pooled connection while 39 callers wait: if
      // waiters held connections, the owner would lose its claim or never complete.
      const pool = countingPool(setup.poolDsn, 4);
      const clients = Array.from({ length: 40 }, (_, i) => makeClient(setup, { pool, listen: i % 2 === 0 }));
      try {
        const key = freshKey('pool4');
        let computed = 0;
        const started = Date.now();
        const results = await Promise.all(clients.map((c) => c.getOrCompute(key, async () => {
          computed += 1;
          await sleep(1500);
          return 'done';
        }, { lease: 1 })));
        const elapsed = Date.now() - started;
        assert.equal(computed, 1);
        assert.deepEqual(results, Array(40).fill('done'));
        assert.ok(elapsed < 4000, `answered after ${elapsed} ms`);
      } finally {
        await Promise.all(clients.map(closeClient));
        await pool.end();
      }
    });

    test('the seed scenario: 50 callers, 5 keys, 1 s computations, finishes quickly', async () => {
      // 10 "pods" with 5 callers each share a pool of 6; every caller asks for every key.
      const pool = countingPool(setup.poolDsn, 6);
      const pods = Array.from({ length: 10 }, () => makeClient(setup, { pool }));
      try {
        const keys = Array.from({ length: 5 }, (_, i) => freshKey(`seed${i}`));
        let computed = 0;
        const started = Date.now();
        const served = (await Promise.all(pods.flatMap((pod) => Array.from({ length: 5 }, async (_, n) => {
          const pages = [];
          for (let i = 0; i < keys.length; i += 1) {
            const key = keys[(n + i) % keys.length];
            pages.push(await pod.getOrCompute(key, async () => {
              computed += 1;
              await sleep(1000);
              return { url: key };
            }, { ttl: 3600 }));
          }
          return pages;
        })))).flat();
        const elapsed = Date.now() - started;
        assert.equal(served.length, 250);
        assert.equal(computed, 5);
        assert.ok(elapsed < 5000, `seed took ${elapsed} ms`);
      } finally {
        await Promise.all(pods.map(closeClient));
        await pool.end();
      }
    });

    test('a compute that throws: one attempt, the error shared with other processes, then retried after retryAfter', async () => {
      const key = freshKey('fails');
      const other = makeClient(setup);
      try {
        let attempts = 0;
        const boom = new Error('upstream returned 503');
        const compute = async () => {
          attempts += 1;
          await sleep(300);
          throw boom;
        };
        const mine = Array.from({ length: 4 }, () => client.getOrCompute(key, compute, { retryAfter: 2 }));
        await sleep(50); // the claim is ours
        const theirs = Array.from({ length: 4 }, () => other.getOrCompute(key, compute, { retryAfter: 2 }));
        // Both settled at once: the other process may see the shared failure before the
        // owner's calls reject, and a rejection with no handler yet fails the test run.
        const [mineSettled, theirsSettled] = await Promise.all([Promise.allSettled(mine), Promise.allSettled(theirs)]);
        for (const outcome of mineSettled) {
          assert.equal(outcome.status, 'rejected');
          assert.equal(outcome.reason, boom, 'the owner process gets the compute error itself');
        }
        for (const outcome of theirsSettled) {
          assert.equal(outcome.status, 'rejected');
          assert.ok(outcome.reason instanceof OnceFailed, String(outcome.reason));
          assert.equal(outcome.reason.key, key);
          assert.match(outcome.reason.error, /upstream returned 503/);
          assert.ok(outcome.reason.retryAt instanceof Date && outcome.reason.retryAt > new Date());
        }
        assert.equal(attempts, 1);
        // Not stuck: once retryAfter has passed, the next caller computes again.
        await assert.rejects(other.getOrCompute(key, () => 'x'), OnceFailed);
        await sleep(2100);
        assert.equal(await other.getOrCompute(key, () => 'recovered'), 'recovered');
      } finally {
        await closeClient(other);
      }
    });

    for (const [what, make] of [
      ['a BigInt', () => ({ n: 10n })],
      ['a cycle', () => { const o = {}; o.self = o; return o; }],
      ['undefined', () => undefined],
    ]) {
      test(`a result that is not JSON-serialisable (${what}): NotSerializable, and the key is not stuck`, async () => {
        const key = freshKey('unserialisable');
        await assert.rejects(client.getOrCompute(key, make, { retryAfter: 0 }), (err) => {
          assert.ok(err instanceof NotSerializable);
          assert.match(err.message, /not serializable.*pass serialize/);
          assert.ok(err.message.includes(key));
          return true;
        });
        const started = Date.now();
        assert.equal(await client.getOrCompute(key, () => 'fine'), 'fine');
        assert.ok(Date.now() - started < 1000);
      });
    }

    test('a result the server refuses (\\u0000 in a string): a clear error, and the key is not stuck', async () => {
      const key = freshKey('nul');
      await assert.rejects(client.getOrCompute(key, () => 'a\u0000b', { retryAfter: 0 }), OnceError);
      assert.equal(await client.getOrCompute(key, () => 'fine'), 'fine');
    });

    test('null is a result, cached like any other', async () => {
      const key = freshKey('null');
      assert.equal(await client.getOrCompute(key, () => null), null);
      assert.equal(await client.getOrCompute(key, () => assert.fail('recomputed')), null);
    });

    test('a caller whose wait runs out gets OnceTimeout naming the key', async () => {
      const key = freshKey('timeout');
      const other = makeClient(setup);
      try {
        const { started, compute } = announced(async () => { await sleep(1500); return 1; });
        const slow = client.getOrCompute(key, compute);
        await started;
        await assert.rejects(other.getOrCompute(key, () => 2, { wait: 0.5 }), (err) => {
          assert.ok(err instanceof OnceTimeout);
          assert.ok(err.message.includes(key));
          return true;
        });
        assert.equal(await slow, 1);
      } finally {
        await closeClient(other);
      }
    });

    test('listen: false polls, and still computes once', async () => {
      const clients = Array.from({ length: 3 }, () => makeClient(setup, { listen: false }));
      try {
        assert.equal(clients[0].ownerPid, 0);
        const key = freshKey('polling');
        let computed = 0;
        const started = Date.now();
        const results = await Promise.all(clients.flatMap((c) => [1, 2, 3].map(() => c.getOrCompute(key, async () => {
          computed += 1;
          await sleep(400);
          return 'polled';
        }))));
        assert.equal(computed, 1);
        assert.deepEqual(results, Array(9).fill('polled'));
        assert.ok(Date.now() - started < 2500);
      } finally {
        await Promise.all(clients.map(closeClient));
      }
    });

    test('cached() keys a function by its arguments', async () => {
      const prefix = freshKey('cached');
      const calls = [];
      const square = client.cached(async (n) => { calls.push(n); return n * n; }, { key: (n) => `${prefix}/${n}`, ttl: 60 });
      assert.deepEqual([await square(3), await square(3), await square(4)], [9, 9, 16]);
      assert.deepEqual(calls, [3, 4]);
      const named = client.cached(async function cube(n) { calls.push(-n); return n ** 3; }, { name: prefix });
      assert.deepEqual([await named(2), await named(2)], [8, 8]);
      assert.deepEqual(calls, [3, 4, -2]);
      assert.throws(() => client.cached(function named() { return 1; }), /needs a name/, 'fn.name is not a key');
    });

    test('OnceClient.connect owns its pool and listener', async () => {
      const c = await OnceClient.connect(setup.poolDsn, { listenConnectionString: setup.listenDsn, poolSize: 2, onError: () => {} });
      assert.ok(c.ownerPid > 0);
      assert.deepEqual(await c.getOrCompute(freshKey('connect'), () => [1, 2]), [1, 2]);
      await c.end();
      assert.equal(c.pool.ending, true);
    });
  });
}

describe('namespaces', { skip: !DSN && 'PG_ONCE_DSN is not set' }, () => {
  test('a waiter for a key in a namespace that announces digests is woken by its digest', async () => {
    // Such a namespace sends encode(once.key_hash(key), 'hex') instead of the key.
    const a = await admin();
    const prefix = `${freshKey('ns')}/`;
    const key = `${prefix}k`;
    const listener = new Listener({ connectionString: DSN }, { onError: () => {}, ownerSession: () => true });
    try {
      await a.query('SELECT once.create_namespace($1, current_user::regrole)', [prefix]);
      const { rows: [{ digest }] } = await a.query("SELECT encode(once.key_hash($1), 'hex') AS digest", [key]);
      assert.deepEqual(notifiedNames(key), [key, digest]);
      await listener.ownerPid();
      const interest = listener.interest(key);
      interest.arm();
      const { rows: [{ token }] } = await a.query('SELECT token FROM once.claim_key($1)', [key]);
      const started = Date.now();
      const woken = interest.wait(10_000);
      await a.query("SELECT once.complete_key($1, $2, '1')", [key, token]);
      await woken;
      assert.ok(Date.now() - started < 5_000, 'woken by the notification, not by the 10 s timeout');
      interest.dispose();
    } finally {
      await listener.close();
      await a.query('SELECT once.invalidate_key($1)', [key]);
      await a.query('SELECT once.drop_namespace($1)', [prefix]).catch(() => {});
      await a.end();
    }
  });
});
