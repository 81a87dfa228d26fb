// What runs with no server: default keys, serialization, option checks, which errors are
// retried, the heartbeat's schedule. (The conformance vectors run in conformance.test.js.)
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import pg from 'pg';
import { defaultKey, MAX_KEY_BYTES, OnceClient, NotSerializable } from '../src/index.mjs';
import { encode } from '../src/keys.cjs';
import { serializer, toText } from '../src/values.cjs';
import { isConnectionError } from '../src/util.cjs';
import { Heartbeat, HEARTBEAT_RETRY_MS } from '../src/protocol.cjs';

// A pool that never connects: constructing a client and checking options needs no server.
const offlineClient = (options = {}) => new OnceClient({ pool: new pg.Pool({ max: 1 }), listen: false, ...options });

describe('default keys (rule K)', () => {
  test('Map, Set, Date and Buffer arguments give distinct keys (JSON.stringify made them all {})', () => {
    const keys = [
      [new Map([[1, 'a']])], [new Map([[2, 'b']])], [new Set([1])], [new Set([2])], [{}],
      [new Date(0)], [new Date(1)], [Buffer.from('a')], [Buffer.from('b')],
    ].map((args) => defaultKey('f', args));
    assert.equal(new Set(keys).size, keys.length, keys.join('\n'));
  });

  test('one key for equal arguments whatever their order of insertion', () => {
    assert.equal(defaultKey('f', [{ b: 1, a: 2 }]), defaultKey('f', [{ a: 2, b: 1 }]));
    assert.equal(defaultKey('f', [new Set([2, 1])]), defaultKey('f', [new Set([1, 2])]));
    assert.equal(defaultKey('f', [{ a: 2, b: 1 }]), 'f:[{"a":2,"b":1}]');
    assert.equal(defaultKey('report', [7, 'eu', 1.5, 2n ** 70n, 1e21]), 'report:[7,"eu",1.5,1180591620717411303424,1e+21]');
    assert.equal(defaultKey('d', [new Date(Date.UTC(2026, 11, 2, 10))]), 'd:[datetime("2026-12-02T10:00:00+00:00")]');
  });

  test('anything else is a TypeError that says to pass key', () => {
    class Point { constructor() { this.x = 1; } }
    for (const bad of [new Point(), undefined, () => 1, Symbol('s'), NaN, Infinity]) {
      assert.throws(() => defaultKey('f', [bad]), (err) => err instanceof TypeError && /pass key/.test(err.message), String(bad?.toString?.()));
    }
  });

  test('a key over the server limit is hashed (K3), one the caller wrote is refused', async () => {
    const key = defaultKey('f', ['x'.repeat(MAX_KEY_BYTES)]);
    assert.match(key, /^f:#sha256:[0-9a-f]{64}$/);
    assert.notEqual(key, defaultKey('f', ['x'.repeat(MAX_KEY_BYTES + 1)]));
    const client = offlineClient();
    await assert.rejects(client.getOrCompute('k'.repeat(MAX_KEY_BYTES + 1), () => 1), RangeError);
    await client.pool.end();
  });

  test('cached() needs a name or a key function: fn.name changes under minifiers', async () => {
    const client = offlineClient();
    assert.throws(() => client.cached(function report() {}), /needs a name/);
    assert.throws(() => client.cached(() => 1, { key: 'prefix' }), /takes a function/);
    const f = client.cached(() => 1, { name: 'f' });
    await assert.rejects(f(new Map([[{}, 1]]).keys()), /pass key/);
    assert.equal(typeof f.invalidate, 'function');
    assert.equal(typeof f.refresh, 'function');
    await client.pool.end();
  });
});

describe('serialization', () => {
  test('JSON refuses what it would not give back unchanged, naming the type and where', () => {
    class Money { toJSON() { return 1; } }
    for (const [value, what] of [
      [{ when: new Date() }, /a Date at \$\.when/], [[1n], /a bigint at \$\[0\]/], [new Map(), /a Map at \$/],
      [new Set(), /a Set/], [{ u: undefined }, /undefined at \$\.u/], [new Money(), /a Money/], [[NaN], /NaN/],
    ]) {
      assert.throws(() => toText('k', value, serializer()), (err) => err instanceof NotSerializable && what.test(err.message) && /pass serialize/.test(err.message));
    }
    assert.equal(toText('k', { a: [1, 'x', null, true] }, serializer()), '{"a":[1,"x",null,true]}');
  });

  test('serialize and deserialize go together', () => {
    assert.throws(() => serializer({ serialize: JSON.stringify }), /together/);
    assert.throws(() => offlineClient({ serialize: JSON.stringify }), /together/);
    assert.throws(() => serializer({ serialize: 1, deserialize: 2 }), /must be functions/);
  });
});

describe('options', () => {
  test('bad options are refused before anything runs', async () => {
    const client = offlineClient();
    for (const bad of [{ wait: -1 }, { lease: 0 }, { ttl: 'soon' }, { stale: 5 }, { ttl: 1, beta: 101 }, { signal: {} }]) {
      await assert.rejects(client.getOrCompute('k', () => 1, bad), TypeError, JSON.stringify(bad));
    }
    await client.pool.end();
  });
});

describe('retries', () => {
  test('only connection failures are retried', () => {
    const err = (code, message = 'x') => Object.assign(new Error(message), { code });
    for (const e of [err('08006'), err('08001'), err('57P01'), err('57P02'), err('57P03'), err('ECONNRESET'),
      err(undefined, 'Connection terminated unexpectedly')]) assert.ok(isConnectionError(e), `${e.code} ${e.message}`);
    for (const e of [err('57014'), err('40001'), err('22023'), err('54000'), err('55P03'), err(undefined, 'boom')]) {
      assert.ok(!isConnectionError(e), `${e.code} ${e.message}`);
    }
  });
});

// How late a call may end past its budget on a loaded machine: the scheduler, nothing
// that grows with the budget.
const SLACK_MS = 2000;

describe('retry budget (R2)', () => {
  // A pool whose every query fails as a lost connection does. `sent`: when each attempt
  // started; `secondAtOnce`: the second attempt came before the event loop turned once
  // after the first (no pause between them, whatever the machine's load).
  const failingPool = () => {
    const pool = { options: {}, sent: [], secondAtOnce: null, on() {} };
    let turned = false;
    pool.query = async () => {
      pool.sent.push(Date.now());
      if (pool.sent.length === 1) setImmediate(() => { turned = true; });
      if (pool.sent.length === 2) pool.secondAtOnce = !turned;
      throw Object.assign(new Error('Connection terminated unexpectedly'), {});
    };
    // Retries take a connection themselves, to bound their wait for it (R2).
    pool.connect = async () => ({ query: (text, values) => pool.query(text, values), release() {} });
    return pool;
  };

  test('a statement is retried for connectTimeout, not 4 attempts, and not past it', async () => {
    const pool = failingPool();
    const client = new OnceClient({ pool, listen: false, connectTimeout: 2, onError: () => {} });
    const started = Date.now();
    await assert.rejects(client.invalidate('k'), /Connection terminated/);
    const took = Date.now() - started;
    assert.ok(pool.sent.length > 4, `${pool.sent.length} attempts`);
    assert.ok(took <= 2000 + SLACK_MS, `${took} ms`);
    assert.equal(pool.secondAtOnce, true, 'the second attempt goes at once');
  });

  test("a claim is retried until the caller's wait, no longer", async () => {
    const pool = failingPool();
    const client = new OnceClient({ pool, listen: false, connectTimeout: 10, onError: () => {} });
    // Servers of every capability, answered before the claim.
    const query = pool.query;
    pool.query = async (text, values) => (text.includes('pg_namespace')
      ? { rows: [{ installed: true, owner_session: true, claim_owner: true, claim_next_wait: true, freshness: true, fingerprint: true }] }
      : query(text, values));
    const started = Date.now();
    await assert.rejects(client.getOrCompute('k', () => 1, { wait: 1.5 }), /Connection terminated/);
    const took = Date.now() - started;
    assert.ok(pool.sent.length > 2, `${pool.sent.length} attempts`);
    assert.ok(took <= 1500 + SLACK_MS, `${took} ms`);
  });
});

describe("a retry's connection that ends during its statement (R2)", () => {
  test('is an error of the call, retried, never an uncaught exception of the process', async () => {
    // pg emits 'error' on a client whose connection ends, besides failing its query:
    // pool.query listens for it, a client checked out with pool.connect() must.
    let attempts = 0;
    const lost = () => Object.assign(new Error('Connection terminated unexpectedly'), {});
    const checkedOut = () => {
      const client = new EventEmitter();
      client.query = () => new Promise((resolve, reject) => {
        attempts += 1;
        setImmediate(() => {
          const err = lost();
          client.emit('error', err);
          reject(err);
        });
      });
      client.release = () => {};
      return client;
    };
    const pool = {
      options: {},
      on() {},
      query: async () => { attempts += 1; throw lost(); },
      connect: async () => checkedOut(),
    };
    const client = new OnceClient({ pool, listen: false, connectTimeout: 0.5, onError: () => {} });
    await assert.rejects(client.invalidate('k'), /Connection terminated/);
    assert.ok(attempts > 2, `${attempts} attempts`);
  });
});

describe("a retry's wait for a pooled connection (R2)", () => {
  test("ends at the claim's deadline, with the error it retries", async () => {
    let released = 0;
    let claims = 0;
    const lost = () => Object.assign(new Error('Connection terminated unexpectedly'), {});
    const pool = {
      options: {},
      on() {},
      query: async (text) => {
        if (text.includes('pg_namespace')) {
          return { rows: [{ installed: true, owner_session: true, claim_owner: true, claim_next_wait: true, freshness: true, fingerprint: true }] };
        }
        claims += 1;
        // The first attempt's connection breaks; after that pool.query would wait 3 s for one.
        if (claims > 1) await new Promise((resolve) => { setTimeout(resolve, 3000); });
        throw lost();
      },
      // Every connection is busy: one comes back only after 3 s.
      connect: () => new Promise((resolve) => {
        setTimeout(() => resolve({ query: async () => ({ rows: [] }), release() { released += 1; } }), 3000).unref();
      }),
    };
    const client = new OnceClient({ pool, listen: false, connectTimeout: 10, onError: () => {} });
    const started = Date.now();
    await assert.rejects(client.getOrCompute('k', () => 1, { wait: 0.3 }), /Connection terminated/);
    const took = Date.now() - started;
    assert.ok(took <= 300 + SLACK_MS, `${took} ms`); // not the 3 s the connection takes
    assert.equal(released, 0); // the late connection goes back to the pool when it comes
  });
});

describe('heartbeat', () => {
  test('after a failed beat the next comes within a second, not lease/3 later', async () => {
    const beats = [];
    const query = async () => {
      beats.push(Date.now());
      if (beats.length === 1) throw Object.assign(new Error('Connection terminated'), {});
      return { rows: [{ expires: new Date() }] };
    };
    const hb = new Heartbeat(query, () => {}, 'k', '1', 6, () => {}); // beats every 2 s
    try {
      while (beats.length < 2) await new Promise((r) => setTimeout(r, 50));
    } finally {
      hb.stop();
    }
    assert.ok(beats[1] - beats[0] <= HEARTBEAT_RETRY_MS + 300, `${beats[1] - beats[0]} ms`);
  });
});
