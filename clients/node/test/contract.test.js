// The behaviours of docs/clients.md that issue 24 fixed, against a real server, in every setup.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import {
  setups, makeClient, closeClient, freshKey, sleep, admin, BOUNCER_DSN, DSN,
} from './helpers.js';
import {
  ClaimLost, NotSerializable,
} from '../src/index.mjs';

const dateSerializer = {
  serialize: (v) => JSON.stringify(v, function tagDates(k, x) { return this[k] instanceof Date ? { $date: x } : x; }),
  deserialize: (t) => JSON.parse(t, (k, x) => (x && typeof x === 'object' && '$date' in x ? new Date(x.$date) : x)),
};

for (const setup of setups) {
  describe(`contract (${setup.name})`, () => {
    let client;
    let other; // as another process
    let a;
    before(async () => {
      client = makeClient(setup);
      other = makeClient(setup);
      a = await admin();
    });
    after(async () => {
      await Promise.all([closeClient(client), closeClient(other)]);
      await a.end();
    });

    test('the computing caller and every reader get the same value, through serialize/deserialize', async () => {
      const key = freshKey('serialize');
      const when = new Date(Date.UTC(2026, 11, 2));
      const mine = await client.getOrCompute(key, () => ({ when }), dateSerializer);
      const theirs = await other.getOrCompute(key, () => assert.fail('recomputed'), dateSerializer);
      assert.ok(mine.when instanceof Date && theirs.when instanceof Date);
      assert.deepEqual(mine, theirs);
      assert.notEqual(mine.when, when, 'a copy, as the others read it, not the computed object');
    });

    test('a lost claim throws ClaimLost; the result is neither stored nor computed again', async () => {
      const key = freshKey('lost');
      let computed = 0;
      const computing = client.getOrCompute(key, async ({ signal }) => {
        computed += 1;
        await sleep(1200);
        assert.ok(signal.aborted, 'compute is told the claim is gone');
        return 'late';
      }, { lease: 0.9 });
      await sleep(150);
      await a.query('SELECT once.invalidate_keys(prefix => $1)', [key]);
      await assert.rejects(computing, ClaimLost);
      const { rows } = await a.query("SELECT state FROM once.entries WHERE key = $1 AND state = 'done'", [key]);
      assert.equal(rows.length, 0, 'nothing stored');
      assert.equal(computed, 1);
    });

    test('invalidate, refresh, enqueue, enqueueMany, and invalidate/refresh on a cached wrapper', async () => {
      const name = freshKey('wrapped');
      let n = 0;
      const f = client.cached(async (x) => { n += 1; return x * 10 + n; }, { name, ttl: 60 });
      assert.equal(await f(1), 11);
      assert.equal(await f(1), 11);
      assert.equal(await f.invalidate(1), true);
      assert.equal(await f(1), 12);
      assert.equal(await f.refresh(1), 'expired');
      assert.equal(await f(1), 13);
      assert.equal(await client.invalidate(freshKey('absent')), false);
      assert.equal(await client.refresh(freshKey('absent')), 'absent');
      const queued = freshKey('queued');
      await a.query("SELECT once.create_queue('node-contract')").catch(() => {});
      assert.equal(await client.enqueue(queued, { payload: { a: 1 }, queue: 'node-contract' }), 'queued');
      assert.equal(await client.enqueue(queued, { payload: { a: 1 }, queue: 'node-contract' }), 'duplicate');
      await assert.rejects(client.enqueue(queued, { payload: new Date() }), NotSerializable);
      // The batch form: one statement, each key answered as enqueue would, in order.
      const [b1, b2] = [freshKey('batch-1'), freshKey('batch-2')];
      const answered = await client.enqueueMany([b1, { key: queued, payload: { a: 2 } }, { key: b2, payload: { b: 2 } }],
        { queue: 'node-contract', priority: 3 });
      assert.deepEqual([...answered], [[b1, 'queued'], [queued, 'duplicate'], [b2, 'queued']]);
      const { rows } = await a.query('SELECT payload, priority FROM once.entries WHERE key = $1', [b2]);
      assert.deepEqual(rows, [{ payload: { b: 2 }, priority: 3 }]);
      assert.deepEqual([...await client.enqueueMany([], { queue: 'node-contract' })], []);
      await assert.rejects(client.enqueueMany([b1, b1], { queue: 'node-contract' }), (err) => err.code === '22023');
      await assert.rejects(client.enqueueMany([{ key: freshKey('b3'), payload: new Date() }]), NotSerializable);
      await assert.rejects(client.enqueueMany('one key'), TypeError);
    });
  });
}

// A LISTEN connection through PgBouncer in transaction mode is refused: the conformance
// scenarios of pooler.json (rule N5).
// PG_ONCE_SESSION_BOUNCER_DSN: a PgBouncer in session mode, through which LISTEN works.
describe('a LISTEN connection through a session pooler', { skip: !process.env.PG_ONCE_SESSION_BOUNCER_DSN && 'PG_ONCE_SESSION_BOUNCER_DSN is not set' }, () => {
  test('is accepted (its notification probe arrives)', async () => {
    const dsn = process.env.PG_ONCE_SESSION_BOUNCER_DSN;
    const client = makeClient({ poolDsn: dsn, listenDsn: dsn });
    try {
      await client.ready();
      assert.ok(client.ownerPid > 0);
      assert.equal(await client.getOrCompute(freshKey('session'), () => 'ok'), 'ok');
    } finally {
      await closeClient(client);
    }
  });
});

// N4: a LISTEN connection whose network goes silent (no FIN, no RST) is noticed by the
// check every 5 s, and replaced.
describe('a LISTEN connection that goes silent', { skip: !DSN && 'PG_ONCE_DSN is not set' }, () => {
  test('is noticed within two checks and replaced', { timeout: 30_000 }, async () => {
    const target = new URL(DSN);
    let silent = false;
    const sockets = new Set();
    const proxy = net.createServer((inbound) => {
      const outbound = net.connect(Number(target.port || 5432), target.hostname);
      for (const [from, to] of [[inbound, outbound], [outbound, inbound]]) {
        from.on('data', (chunk) => { if (!silent) to.write(chunk); });
        from.on('error', () => {});
        from.on('close', () => to.destroy());
        sockets.add(from);
      }
    });
    await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
    const via = new URL(DSN);
    via.host = `127.0.0.1:${proxy.address().port}`;
    const errors = [];
    const client = makeClient({ poolDsn: DSN, listenDsn: via.toString() }, { onError: (e) => errors.push(e) });
    try {
      await client.ready();
      const before = client.ownerPid;
      silent = true; // every byte dropped from now on, both ways
      const started = Date.now();
      while (!errors.some((e) => /LISTEN connection failed/.test(e.message)) && Date.now() - started < 12_000) await sleep(100);
      assert.ok(Date.now() - started < 12_000, 'noticed within two 5 s checks');
      silent = false;
      for (const s of sockets) s.destroy(); // the old connection is gone for good
      await client.ready();
      assert.ok(client.ownerPid > 0 && client.ownerPid !== before, `${before} -> ${client.ownerPid}`);
    } finally {
      await closeClient(client);
      for (const s of sockets) s.destroy();
      proxy.close();
    }
  });
});
