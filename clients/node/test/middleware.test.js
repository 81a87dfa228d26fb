// The Express middleware and the Fastify plugin (docs/clients.md, rule I) against the real
// server, each app listening on an ephemeral port and driven over HTTP with fetch.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { Readable } from 'node:stream';
import express from 'express';
import Fastify from 'fastify';
import pg from 'pg';
import { idempotency, idempotencyErrors, idempotencyPlugin, OnceClient } from '../src/index.mjs';
import { entryKey } from '../src/idempotency.cjs';
import { DSN, admin, sleep } from './helpers.js';

const SCHEMA = 'node_idempotency_test';
// What the middlewares under test are keyed with (rule I2).
const SECRET = 'pg-once node middleware tests, 32+ bytes';

/**
 * The routes every app serves, one handler behind several configurations (a smaller
 * version of clients/conformance/http/README.md's): the handler counts its runs per
 * Idempotency-Key and writes its order in one transaction, completing the claim there (I8).
 */
const ROUTES = {
  '/orders': {},
  '/wait/orders': { inFlight: 'wait', wait: 10 },
  '/strict/orders': { required: true },
  '/small/orders': { maxBody: 1000, maxRequestBody: 2000 },
  '/short/orders': { lease: 1 },
};

function makeHandler(pool) {
  const runs = new Map();
  const gates = new Map(); // name -> { opened: Promise, open() }
  const gate = (name) => {
    if (!gates.has(name)) {
      let open;
      const opened = new Promise((resolve) => { open = resolve; });
      gates.set(name, { opened, open, reached: null });
    }
    return gates.get(name);
  };
  /** What the handler answers: { status, headers, body } or { status, headers, stream }. */
  async function handle(key, input, claim) {
    runs.set(key, (runs.get(key) ?? 0) + 1);
    const o = { status: 201, sleep_ms: 0, raise: false, size: 0, chunks: 0, ...input };
    if (o.gate) {
      gate(o.gate).reached?.();
      await gate(o.gate).opened;
    }
    await sleep(o.sleep_ms);
    if (o.raise) throw new Error('asked to raise');
    if (o.status >= 500) return { status: o.status, headers: { 'content-type': 'application/json' }, body: '{"error": "asked"}' };
    if (o.chunks > 0) {
      await pool.query(`INSERT INTO ${SCHEMA}.orders (idempotency_key, sku) VALUES ($1, $2)`, [key, JSON.stringify(o.sku ?? null)]);
      const stream = Readable.from((async function* chunks() {
        for (let i = 0; i < o.chunks; i += 1) {
          yield Buffer.alloc(o.size, String.fromCharCode(97 + i));
          await sleep(10);
        }
      })(), { objectMode: false });
      return { status: 201, headers: { 'content-type': 'text/plain' }, stream };
    }
    const conn = await pool.connect();
    try {
      await conn.query('BEGIN');
      const { rows: [{ id }] } = await conn.query(
        `INSERT INTO ${SCHEMA}.orders (idempotency_key, sku) VALUES ($1, $2) RETURNING id::int`, [key, JSON.stringify(o.sku ?? null)]);
      const body = JSON.stringify({ order_id: id, sku: o.sku ?? null, padding: 'x'.repeat(o.size) });
      const headers = { 'content-type': 'application/json', location: `/orders/${id}`, 'set-cookie': 'visited=1' };
      await claim?.complete(conn, o.status, headers, body);
      await conn.query('COMMIT');
      return { status: o.status, headers, body };
    } catch (err) {
      await conn.query('ROLLBACK');
      throw err;
    } finally {
      conn.release();
    }
  }
  return { handle, runs, gate };
}

async function expressApp(client, handler) {
  const app = express();
  for (const [path, options] of Object.entries(ROUTES)) {
    app.use(path, idempotency({ client, secret: SECRET, ttl: 3600, onError: () => {}, ...options }));
  }
  app.use(express.json());
  app.get('/orders', (req, res) => res.json({ listing: true }));
  app.post(Object.keys(ROUTES), async (req, res) => {
    const answer = await handler.handle(req.get('idempotency-key') ?? null, req.body, req.idempotency);
    res.writeHead(answer.status, answer.headers);
    if (answer.stream) answer.stream.pipe(res);
    else res.end(answer.body);
  });
  app.use(idempotencyErrors());
  const server = app.listen(0, '127.0.0.1');
  await new Promise((resolve) => server.once('listening', resolve));
  return { url: `http://127.0.0.1:${server.address().port}`, close: () => new Promise((r) => { server.closeAllConnections(); server.close(r); }) };
}

async function fastifyApp(client, handler) {
  const app = Fastify();
  for (const [path, options] of Object.entries(ROUTES)) {
    app.register(async (scope) => {
      await scope.register(idempotencyPlugin, { client, secret: SECRET, ttl: 3600, onError: () => {}, ...options });
      scope.post('/orders', async (request, reply) => {
        const answer = await handler.handle(request.headers['idempotency-key'] ?? null, request.body, request.idempotency);
        reply.code(answer.status).headers(answer.headers);
        return reply.send(answer.stream ?? answer.body);
      });
      if (path === '/orders') scope.get('/orders', async () => ({ listing: true }));
    }, { prefix: path.slice(0, -'/orders'.length) });
  }
  await app.listen({ port: 0, host: '127.0.0.1' });
  return { url: `http://127.0.0.1:${app.server.address().port}`, close: () => app.close() };
}

const post = (url, body, headers = {}) => fetch(url, {
  method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: typeof body === 'string' ? body : JSON.stringify(body),
});
const read = async (res) => ({
  status: res.status, headers: res.headers, text: Buffer.from(await res.arrayBuffer()).toString('latin1'),
});
const problemOf = (r) => {
  assert.equal(r.headers.get('content-type'), 'application/problem+json');
  return JSON.parse(r.text);
};

for (const [name, makeApp] of [['express', expressApp], ['fastify', fastifyApp]]) {
  describe(`idempotency middleware (${name})`, { skip: !DSN && 'PG_ONCE_DSN is not set' }, () => {
    let pool;
    let client;
    let handler;
    let app;
    let db;
    const orders = async (key) => (await db.query(`SELECT count(*)::int AS n FROM ${SCHEMA}.orders WHERE idempotency_key = $1`, [key])).rows[0].n;

    before(async () => {
      db = await admin();
      await db.query(`CREATE SCHEMA IF NOT EXISTS ${SCHEMA};
        CREATE TABLE IF NOT EXISTS ${SCHEMA}.orders (id bigserial PRIMARY KEY, idempotency_key text, sku jsonb)`);
      pool = new pg.Pool({ connectionString: DSN, max: 20 });
      client = await OnceClient.connect(DSN, { onError: () => {} });
      handler = makeHandler(pool);
      app = await makeApp(client, handler);
    });
    after(async () => {
      await app.close();
      await client.end();
      await pool.end();
      await db.end();
    });

    test('concurrent duplicates: one run, the rest 409 in_flight; a retry is the stored response, replayed', async () => {
      const key = randomUUID();
      const answers = await Promise.all(Array.from({ length: 10 }, () => post(`${app.url}/orders`, { sku: 'a', sleep_ms: 500 }, { 'idempotency-key': key }).then(read)));
      assert.equal(handler.runs.get(key), 1);
      const first = answers.find((r) => r.status === 201);
      const conflicts = answers.filter((r) => r.status === 409);
      assert.equal(conflicts.length, 9);
      for (const r of conflicts) {
        assert.equal(r.headers.get('retry-after'), '1');
        assert.equal(problemOf(r).code, 'in_flight');
      }
      assert.equal(JSON.parse(first.text).sku, 'a', 'the app got the body the middleware read');
      assert.equal(first.headers.get('idempotent-replayed'), null);
      assert.equal(first.headers.get('set-cookie'), 'visited=1');

      const again = await read(await post(`${app.url}/orders`, { sku: 'a', sleep_ms: 500 }, { 'idempotency-key': key }));
      assert.equal(again.status, 201);
      assert.equal(again.text, first.text);
      assert.equal(again.headers.get('location'), first.headers.get('location'));
      assert.equal(again.headers.get('idempotent-replayed'), 'true');
      assert.equal(again.headers.get('set-cookie'), null, 'cookies are not stored by default');
      assert.equal(handler.runs.get(key), 1);
      assert.equal(await orders(key), 1);
    });

    test('inFlight wait: concurrent duplicates wait for the first and get its response', async () => {
      const key = randomUUID();
      const answers = await Promise.all(Array.from({ length: 10 }, () => post(`${app.url}/wait/orders`, { sku: 'w', sleep_ms: 500 }, { 'idempotency-key': key }).then(read)));
      assert.deepEqual(answers.map((r) => r.status), Array(10).fill(201));
      assert.equal(new Set(answers.map((r) => r.text)).size, 1);
      assert.equal(answers.filter((r) => r.headers.get('idempotent-replayed') === 'true').length, 9);
      assert.equal(handler.runs.get(key), 1);
    });

    test('the claim is heartbeated while the handler runs: a duplicate past the lease still gets 409', async () => {
      const key = randomUUID();
      const first = post(`${app.url}/short/orders`, { sleep_ms: 2500 }, { 'idempotency-key': key }).then(read);
      await sleep(1700); // past the 1 s lease
      const duplicate = await read(await post(`${app.url}/short/orders`, { sleep_ms: 2500 }, { 'idempotency-key': key }));
      assert.equal(duplicate.status, 409);
      assert.equal((await first).status, 201);
      assert.equal(handler.runs.get(key), 1);
    });

    test('an entry another role planted (no fingerprint, its own headers) is 409 untrusted_entry, nothing of it sent', async () => {
      // I6: claim_key + complete_key by any role with pg_once's rights in the key space.
      const key = randomUUID();
      const entry = entryKey('', null, key, Buffer.from(SECRET));
      const planted = { status: 200, headers: [['set-cookie', 'session=attacker'], ['content-length', '2']], body: Buffer.from('okHTTP/1.1 299 X\r\n\r\n').toString('base64') };
      await db.query('SELECT once.complete_key($1, token, $2::jsonb) FROM once.claim_key($1)', [entry, JSON.stringify(planted)]);
      const r = await read(await post(`${app.url}/orders`, { sku: 'p' }, { 'idempotency-key': key }));
      assert.equal(r.status, 409);
      assert.equal(problemOf(r).code, 'untrusted_entry');
      assert.equal(r.headers.get('set-cookie'), null);
      assert.equal(r.headers.get('idempotent-replayed'), null);
      assert.equal(handler.runs.get(key), undefined);
    });

    test('the key again with another body: 422 fingerprint_mismatch, nothing runs', async () => {
      const key = randomUUID();
      assert.equal((await post(`${app.url}/orders`, { sku: 1 }, { 'idempotency-key': key })).status, 201);
      const r = await read(await post(`${app.url}/orders`, { sku: 2 }, { 'idempotency-key': key }));
      assert.equal(r.status, 422);
      assert.equal(problemOf(r).code, 'fingerprint_mismatch');
      assert.equal(handler.runs.get(key), 1);
    });

    test('no header passes through; required answers 400 key_missing; an invalid key 400 key_invalid; GET passes', async () => {
      const before = handler.runs.get(null) ?? 0;
      for (let i = 0; i < 2; i += 1) {
        const r = await read(await post(`${app.url}/orders`, { sku: 'n' }));
        assert.equal(r.status, 201);
        assert.equal(r.headers.get('idempotent-replayed'), null);
      }
      assert.equal(handler.runs.get(null), before + 2);
      const missing = await read(await post(`${app.url}/strict/orders`, { sku: 'n' }));
      assert.equal(missing.status, 400);
      assert.equal(problemOf(missing).code, 'key_missing');
      const invalid = await read(await post(`${app.url}/orders`, { sku: 'n' }, { 'idempotency-key': 'a b' }));
      assert.equal(invalid.status, 400);
      assert.equal(problemOf(invalid).code, 'key_invalid');
      assert.equal(handler.runs.get(null), before + 2, 'nothing ran for the refused ones');
      const listing = await fetch(`${app.url}/orders`, { headers: { 'idempotency-key': 'a b' } });
      assert.equal(listing.status, 200);
    });

    test('one key under two Authorization headers is two requests', async () => {
      const key = randomUUID();
      for (const who of ['Bearer a', 'Bearer b']) {
        assert.equal((await post(`${app.url}/orders`, { sku: 's' }, { 'idempotency-key': key, authorization: who })).status, 201);
      }
      assert.equal(handler.runs.get(key), 2);
    });

    test('a 5xx answer and an exception give the claim back: a retry runs again', async () => {
      const key = randomUUID();
      const r1 = await post(`${app.url}/orders`, { status: 500 }, { 'idempotency-key': key });
      assert.equal(r1.status, 500);
      assert.equal((await post(`${app.url}/orders`, { status: 500 }, { 'idempotency-key': key })).status, 500);
      assert.equal(handler.runs.get(key), 2);

      const raised = randomUUID();
      for (let i = 0; i < 2; i += 1) {
        const r = await read(await post(`${app.url}/orders`, { raise: true }, { 'idempotency-key': raised }));
        assert.equal(r.status, 500);
        assert.equal(problemOf(r).code, 'handler_failed');
      }
      assert.equal(handler.runs.get(raised), 2);
    });

    test('a claim taken over while the handler runs: its completion is refused (ClaimLost), its order rolled back, 409', async () => {
      const key = randomUUID();
      const gate = handler.gate(key);
      const reached = new Promise((resolve) => { gate.reached = resolve; });
      const first = post(`${app.url}/orders`, { sku: 'z', gate: key }, { 'idempotency-key': key }).then(read);
      await reached;
      // The owner session of the claim ends (as when the process stops and its connection is
      // cut), and another process takes the key over.
      await db.query('SELECT pg_terminate_backend($1)', [client.ownerPid]);
      const other = await OnceClient.connect(DSN, { onError: () => {} });
      try {
        let taken;
        for (let i = 0; i < 50 && taken?.outcome !== 'claimed'; i += 1) {
          taken = await other.claim(entryKey('', null, key, Buffer.from(SECRET)), { fingerprint: null });
          if (taken.outcome !== 'claimed') await sleep(100);
        }
        assert.equal(taken.outcome, 'claimed');
        gate.open();
        const r = await first;
        assert.equal(r.status, 409);
        assert.equal(problemOf(r).code, 'in_flight');
        assert.equal(await orders(key), 0, 'the zombie\'s order was rolled back');
        await taken.claim.release();
      } finally {
        await other.end();
      }
    });

    test('a streamed response reaches the caller in chunks, is stored, and replays byte for byte', async () => {
      const key = randomUUID();
      const res = await post(`${app.url}/orders`, { chunks: 5, size: 1000 }, { 'idempotency-key': key });
      const reader = res.body.getReader();
      let pieces = 0;
      let text = '';
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        pieces += 1;
        text += Buffer.from(value).toString('latin1');
      }
      assert.equal(text, ['a', 'b', 'c', 'd', 'e'].map((c) => c.repeat(1000)).join(''));
      assert.ok(pieces > 1, `${pieces} pieces`);
      const again = await read(await post(`${app.url}/orders`, { chunks: 5, size: 1000 }, { 'idempotency-key': key }));
      assert.equal(again.status, 201);
      assert.equal(again.text, text);
      assert.equal(again.headers.get('content-type'), 'text/plain');
      assert.equal(handler.runs.get(key), 1);
    });

    test('a stream broken after its head keeps its claim: stored without its body, the retry is replayed (I5)', async () => {
      const key = randomUUID();
      const input = { chunks: 50, size: 1024 };
      const hangUp = new AbortController();
      const res = await fetch(`${app.url}/orders`, {
        method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(input), signal: hangUp.signal,
      });
      assert.equal(res.status, 201);
      await res.body.getReader().read(); // the first chunk, then the caller goes away
      hangUp.abort();
      await sleep(500);
      const again = await read(await post(`${app.url}/orders`, input, { 'idempotency-key': key }));
      assert.equal(again.status, 201, again.text);
      assert.equal(again.headers.get('idempotent-replayed'), 'true');
      assert.equal(again.text, '');
      assert.equal(again.headers.get('content-type'), 'text/plain');
      assert.equal(handler.runs.get(key), 1);
      assert.equal(await orders(key), 1);
    });

    test('a response past maxBody is sent in full and stored without its body; a request body past maxRequestBody is 413', async () => {
      const key = randomUUID();
      const first = await read(await post(`${app.url}/small/orders`, { size: 1500 }, { 'idempotency-key': key }));
      assert.equal(first.status, 201);
      assert.equal(JSON.parse(first.text).padding.length, 1500);
      const again = await read(await post(`${app.url}/small/orders`, { size: 1500 }, { 'idempotency-key': key }));
      assert.equal(again.status, 201);
      assert.equal(again.text, '');
      assert.equal(again.headers.get('location'), first.headers.get('location'));
      assert.equal(again.headers.get('idempotent-replayed'), 'true');
      assert.equal(handler.runs.get(key), 1);

      const big = randomUUID();
      const r = await read(await post(`${app.url}/small/orders`, { sku: 'x'.repeat(3000) }, { 'idempotency-key': big }));
      assert.equal(r.status, 413);
      assert.equal(problemOf(r).code, 'body_too_large');
      assert.equal(handler.runs.get(big), undefined);
    });

    test('pg_once unreachable: 503 unavailable, the handler does not run', async () => {
      const dead = new OnceClient({ pool: new pg.Pool({ connectionString: 'postgres://postgres@127.0.0.1:1/none', connectionTimeoutMillis: 500 }), listen: false });
      const mw = await makeApp(dead, handler);
      try {
        const key = randomUUID();
        const r = await read(await post(`${mw.url}/orders`, { sku: 1 }, { 'idempotency-key': key }));
        assert.equal(r.status, 503);
        assert.equal(problemOf(r).code, 'unavailable');
        assert.equal(r.headers.get('retry-after'), '1');
        assert.equal(handler.runs.get(key), undefined);
      } finally {
        await mw.close();
      }
    });
  });
}
