// Rule I's pure parts against clients/conformance/vectors/idempotency.json (no server):
// the entry's key, the default scope and fingerprint, the header's value and the stored
// form of a response, byte for byte as the Python and Rust middlewares compute them; and
// the options refused when the middleware is built (I9).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import {
  defaultFingerprint, defaultScope, entryKey, parseKeyHeader, storedResponse, idempotencyOptions, problem,
} from '../src/idempotency.cjs';
import { idempotency, idempotencyPlugin, OnceClient } from '../src/index.mjs';

const DIR = process.env.PG_ONCE_CONFORMANCE_DIR ?? fileURLToPath(new URL('../../conformance', import.meta.url));
const vectors = JSON.parse(readFileSync(`${DIR}/vectors/idempotency.json`, 'utf8'));

/** `{"$bytes": b64}` and `{"$repeat": [s, n]}` of the vector notation. */
const value = (v) => {
  if (v?.$bytes !== undefined) return Buffer.from(v.$bytes, 'base64');
  if (v?.$repeat) return v.$repeat[0].repeat(v.$repeat[1]);
  return v;
};

describe(`vectors/idempotency.json (rule ${vectors.rule})`, () => {
  for (const c of vectors.keys) {
    test(`key: ${c.name}`, () => {
      assert.equal(entryKey(c.namespace, c.scope, c.header), c.key);
      if (c.authorization !== undefined) assert.equal(defaultScope(c.authorization), c.scope);
    });
  }
  for (const c of vectors.fingerprints) {
    test(`fingerprint: ${c.name}`, () => {
      const fp = defaultFingerprint({ method: c.method, path: c.path, query: c.query, body: value(c.body) });
      assert.equal(fp.toString('hex'), c.fingerprint);
    });
  }
  for (const c of vectors.headers) {
    test(`header: ${c.name}`, () => {
      assert.equal(parseKeyHeader(value(c.value)), c.error ? null : value(c.key));
    });
  }
  for (const c of vectors.stored) {
    test(`stored: ${c.name}`, () => {
      assert.deepEqual(storedResponse(c.status, c.response_headers, value(c.body), { storeCookies: c.store_cookies }), c.stored);
    });
  }
});

describe('rule I, beyond the vectors', () => {
  test('a structured-field string with escapes is unquoted; a broken one is refused', () => {
    assert.equal(parseKeyHeader('"a\\"b\\\\c"'), 'a"b\\c');
    for (const bad of ['"a"b"', '"a\\x"', '"a b"', 'a\tb']) assert.equal(parseKeyHeader(bad), null, bad);
  });

  test("problem titles are RFC 9110's phrases, not Node's STATUS_CODES", () => {
    const title = (code) => JSON.parse(problem(code, 'x').body).title;
    assert.equal(title('body_too_large'), 'Content Too Large');
    assert.equal(title('fingerprint_mismatch'), 'Unprocessable Content');
  });

  test('the default scope hashes the Authorization bytes (Node hands them over as latin1)', () => {
    // 'Bearer café' in UTF-8 as it reaches the handler: c3 a9 as two latin1 characters.
    const received = Buffer.from('Bearer café', 'utf8').toString('latin1');
    const sha = (bytes) => createHash('sha256').update(bytes).digest('hex');
    assert.equal(defaultScope(received), sha(Buffer.from('Bearer café', 'utf8')));
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
    for (const [options, error] of bad) {
      assert.throws(() => idempotencyOptions(options), error, JSON.stringify(Object.keys(options)));
      assert.throws(() => idempotency(options), error);
    }
    assert.rejects(() => idempotencyPlugin({}, { client, inFlight: 'queue' }), TypeError);
    const o = idempotencyOptions({ client });
    assert.equal(o.ttl, 86400);
    assert.equal(o.wait, 10);
    assert.deepEqual([...o.methods], ['POST', 'PATCH']);
    assert.equal(o.maxBody, 1024 * 1024);
  });
});
