// Rule I's pure parts against clients/conformance/vectors/idempotency.json (no server):
// the entry's key, the default scope and fingerprint, the header's value and the stored
// form of a response, byte for byte as the Python and Rust middlewares compute them; and
// the options refused when the middleware is built (I9).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import {
  defaultFingerprint, defaultScope, entryKey, keyedFingerprint, parseKeyHeader, requestFingerprint, storedResponse,
  idempotencyOptions, problem, untrusted,
} from '../src/idempotency.cjs';
import { ConfigurationError } from '../src/errors.cjs';
import { idempotency, idempotencyPlugin, OnceClient } from '../src/index.mjs';

const DIR = process.env.PG_ONCE_CONFORMANCE_DIR ?? fileURLToPath(new URL('../../conformance', import.meta.url));
const vectors = JSON.parse(readFileSync(`${DIR}/vectors/idempotency.json`, 'utf8'));

/** `{"$bytes": b64}` and `{"$repeat": [s, n]}` of the vector notation. */
const value = (v) => {
  if (v?.$bytes !== undefined) return Buffer.from(v.$bytes, 'base64');
  if (v?.$repeat) return v.$repeat[0].repeat(v.$repeat[1]);
  return v;
};

/** A case's secret as the middleware holds it (a Buffer of its UTF-8), or null. */
const secretOf = (c) => (c.secret ? Buffer.from(c.secret, 'utf8') : null);
const fingerprintOf = (c) => (c.fingerprint === null ? null : Buffer.from(c.fingerprint, 'hex'));

describe(`vectors/idempotency.json (rule ${vectors.rule})`, () => {
  for (const c of vectors.keys) {
    test(`key: ${c.name}`, () => {
      assert.equal(entryKey(c.namespace, c.scope, c.header, secretOf(c)), c.key);
      if (c.authorization !== undefined) assert.equal(defaultScope(c.authorization), c.scope);
    });
  }
  for (const c of vectors.fingerprints) {
    test(`fingerprint: ${c.name}`, () => {
      const fp = defaultFingerprint({ method: c.method, path: c.path, query: c.query, body: value(c.body) });
      assert.equal(fp.toString('hex'), c.fingerprint);
      assert.equal(keyedFingerprint(Buffer.from(vectors.secret), fp).toString('hex'), c.keyed);
      // What the middleware claims and stores (I3): keyed with a secret, as is without one.
      const request = { method: c.method, url: c.query ? `${c.path}?${c.query}` : c.path, body: value(c.body) };
      const keyed = { fingerprint: defaultFingerprint, secret: Buffer.from(vectors.secret) };
      const plain = { fingerprint: defaultFingerprint, secret: null };
      assert.equal(requestFingerprint(keyed, request).toString('hex'), c.keyed);
      assert.equal(requestFingerprint(plain, request).toString('hex'), c.fingerprint);
    });
  }
  for (const c of vectors.headers) {
    test(`header: ${c.name}`, () => {
      assert.equal(parseKeyHeader(value(c.value)), c.error ? null : value(c.key));
    });
  }
  for (const c of vectors.stored) {
    test(`stored: ${c.name}`, () => {
      const form = { storeCookies: c.store_cookies, secret: secretOf(c), entry: c.entry, fingerprint: fingerprintOf(c) };
      assert.deepEqual(storedResponse(c.status, c.response_headers, c.body === null ? null : value(c.body), form), c.stored);
    });
  }
  for (const c of vectors.replays) {
    // JSON.parse reads 201.0 as 201: Node cannot tell the status jsonb kept as written.
    const todo = c.name === 'status 201.0, MAC right for 201' ? 'finding 1 of the attack-http review' : undefined;
    test(`replay: ${c.name}`, { todo }, () => {
      const why = untrusted({ secret: secretOf(c), storeCookies: c.store_cookies }, c.entry, fingerprintOf(c), c.stored);
      assert.equal(why === null ? 'replayed' : 'untrusted', c.verdict, why ?? '');
    });
  }
  const client = new OnceClient({ pool: new pg.Pool(), listen: false });
  for (const c of vectors.options) {
    test(`options: ${c.name}`, () => {
      const options = { client, ...c.options };
      if (typeof options.scope === 'string') options.scope = () => c.options.scope;
      if (c.error) assert.throws(() => idempotencyOptions(options), ConfigurationError);
      else idempotencyOptions(options);
    });
  }
});

describe('rule I, beyond the vectors', () => {
  test('an entry nested deeper than JSON.stringify reaches is untrusted, not thrown (finding 5)', () => {
    const depth = 20000;
    const nested = JSON.parse('['.repeat(depth) + ']'.repeat(depth));
    for (const member of ['status', 'headers']) {
      const stored = { status: 201, headers: [], body: null, fingerprint: null, mac: '0'.repeat(64) };
      stored[member] = member === 'headers' ? [nested] : nested;
      const why = untrusted({ secret: Buffer.alloc(32, 1) }, 'e', null, stored);
      assert.notEqual(why, null, member);
    }
  });
  test('a structured-field string with escapes is unquoted; a broken one is refused', () => {
    assert.equal(parseKeyHeader('"a\\"b\\\\c"'), 'a"b\\c');
    for (const bad of ['"a"b"', '"a\\x"', '"a b"', 'a\tb']) assert.equal(parseKeyHeader(bad), null, bad);
  });

  test("problem titles are RFC 9110's phrases, not Node's STATUS_CODES", () => {
    const title = (code) => JSON.parse(problem(code, 'x').body).title;
    assert.equal(title('body_too_large'), 'Content Too Large');
    assert.equal(title('fingerprint_mismatch'), 'Unprocessable Content');
  });

  test('the default scope keys the Authorization bytes (Node hands them over as latin1)', () => {
    // 'Bearer café' in UTF-8 as it reaches the handler: c3 a9 as two latin1 characters,
    // each one character of the scope, as Python and Rust read them.
    const received = Buffer.from('Bearer café', 'utf8').toString('latin1');
    assert.equal(defaultScope(received), 'Bearer caf\u00c3\u00a9');
    const secret = Buffer.alloc(32, 1);
    const want = createHmac('sha256', secret).update('["idempotency-key","Bearer caf\u00c3\u00a9","k"]', 'utf8').digest('hex');
    assert.equal(entryKey('', defaultScope(received), 'k', secret), `idempotency:#hmac-sha256:${want}`);
  });

  test('an entry key past the server limit is hashed (rule K3), a scope that is no string refused', () => {
    const key = entryKey('', 'x'.repeat(8000), 'k');
    assert.match(key, /^idempotency:#sha256:[0-9a-f]{64}$/);
    assert.throws(() => entryKey('', 42, 'k'), TypeError);
  });

  test('the default fingerprint uses the request target bytes as Node received them', () => {
    const a = defaultFingerprint({ method: 'post', path: '/a', query: '', body: Buffer.alloc(0) });
    const b = defaultFingerprint({ method: 'POST', path: '/a', query: '', body: Buffer.alloc(0) });
    assert.deepEqual(a, b, 'the method is upper-cased');
    assert.equal(a.length, 32);
  });

  test('with a secret an application\'s fingerprint is keyed too (I3), null stays none', () => {
    const request = { method: 'POST', url: '/', body: Buffer.alloc(0) };
    const secret = Buffer.from(vectors.secret);
    const own = { secret, fingerprint: () => Buffer.from([1]) };
    assert.deepEqual(requestFingerprint(own, request), keyedFingerprint(secret, Buffer.from([1])));
    assert.equal(requestFingerprint({ secret, fingerprint: () => null }, request), null);
    assert.equal(requestFingerprint({ secret, fingerprint: null }, request), null);
    assert.throws(() => requestFingerprint({ secret, fingerprint: () => Buffer.alloc(0) }, request), TypeError);
  });

  test('problem+json answers (I7)', () => {
    const p = problem('in_flight', 'later', { retryAfter: 1 });
    assert.equal(p.status, 409);
    assert.deepEqual(p.headers, [['content-type', 'application/problem+json'], ['retry-after', '1']]);
    assert.deepEqual(JSON.parse(p.body), {
      type: 'about:blank', title: 'Conflict', status: 409, detail: 'later', code: 'in_flight',
    });
  });

  test('options are refused when the middleware is built (I9)', () => {
    const client = new OnceClient({ pool: new pg.Pool(), listen: false });
    const bad = [
      [{}, TypeError], // neither client nor connectionString
      [{ client, connectionString: 'postgres://x/y' }, TypeError],
      [{ client, secret: 'x'.repeat(31) }, ConfigurationError],
      [{ client, secret: 32 }, TypeError],
      [{ client, ttl: -1 }, TypeError],
      [{ client, lease: 0 }, TypeError],
      [{ client, wait: '10' }, TypeError],
      [{ client, inFlight: 'queue' }, TypeError],
      [{ client, methods: [] }, TypeError],
      [{ client, maxBody: 0 }, RangeError],
      [{ client, maxRequestBody: 1.5 }, RangeError],
      [{ client, scope: 'tenant' }, TypeError],
      [{ client, store: null }, TypeError],
      [{ client, header: 'Idempotency Key' }, TypeError],
      [{ client, max_body: 10 }, TypeError], // snake_case is another language's spelling
    ];
    for (const [given, error] of bad) {
      const options = 'secret' in given || !given.client ? given : { secret: 'x'.repeat(32), ...given };
      assert.throws(() => idempotencyOptions(options), error, JSON.stringify(Object.keys(options)));
      assert.throws(() => idempotency(options), error);
    }
    assert.rejects(() => idempotencyPlugin({}, { client, secret: 'x'.repeat(32), inFlight: 'queue' }), TypeError);
    assert.throws(() => idempotencyOptions({ client }), ConfigurationError, 'the default scope without a secret');
    assert.throws(() => idempotency({ client }), ConfigurationError);
    const o = idempotencyOptions({ client, secret: 'x'.repeat(32) });
    assert.equal(o.ttl, 86400);
    assert.equal(o.wait, 10);
    assert.deepEqual([...o.methods], ['POST', 'PATCH']);
    assert.equal(o.maxBody, 1024 * 1024);
  });
});
