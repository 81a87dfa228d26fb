// TLS (docs/clients.md, N3): with PG_ONCE_TLS_URL, a postgres:// URL with
// sslmode=verify-full&sslrootcert=... to a server that takes TCP only over TLS, the pool's
// connections and the LISTEN connection are encrypted and verified with that CA.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { OnceClient } from '../src/index.mjs';
import { freshKey, sleep } from './helpers.js';

const TLS_URL = process.env.PG_ONCE_TLS_URL;
const PUBLIC_ROOTS = '/etc/ssl/certs/ca-certificates.crt'; // public CAs: not the test server's

/** TLS_URL with its query parameters changed. */
function withParams(params) {
  const url = new URL(TLS_URL);
  for (const [k, v] of Object.entries(params)) url.searchParams.set(k, v);
  return url.toString();
}

const SSL_OF = 'SELECT ssl FROM pg_stat_ssl WHERE pid = $1';

describe('TLS', { skip: !TLS_URL && 'PG_ONCE_TLS_URL is not set' }, () => {
  test('the pool and the LISTEN connection both connect over verified TLS, and notifications arrive', async () => {
    const a = await OnceClient.connect(TLS_URL, { onError: () => {} });
    const b = await OnceClient.connect(TLS_URL, { onError: () => {}, recheck: 30 });
    try {
      const { rows: [pooled] } = await a.pool.query('SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()');
      assert.equal(pooled.ssl, true, 'pooled connection');
      const { rows: [listening] } = await a.pool.query(SSL_OF, [a.ownerPid]);
      assert.equal(listening.ssl, true, 'LISTEN connection');
      const key = freshKey('tls');
      const computing = a.getOrCompute(key, async () => { await sleep(500); return 'over tls'; });
      await sleep(100);
      const started = Date.now();
      assert.equal(await b.getOrCompute(key, () => assert.fail('computed twice')), 'over tls');
      assert.ok(Date.now() - started < 3000, 'woken by the notification, not the 30 s recheck');
      await computing;
    } finally {
      await Promise.all([a.end(), b.end()]);
    }
  });

  test('sslrootcert is honoured: a CA that did not sign the server is refused', { skip: !existsSync(PUBLIC_ROOTS) && `no ${PUBLIC_ROOTS}` }, async () => {
    await assert.rejects(OnceClient.connect(withParams({ sslrootcert: PUBLIC_ROOTS }), { connectTimeout: 1, onError: () => {} }),
      /certificate|self.signed|verify/i);
  });

  test('the server takes no plain TCP: sslmode=disable is refused', async () => {
    await assert.rejects(OnceClient.connect(withParams({ sslmode: 'disable' }), { connectTimeout: 1, onError: () => {} }),
      /no encryption|pg_hba/);
  });

  test("libpq's PG* environment variables, PGSSLROOTCERT included, when no connection string is given", async () => {
    const url = new URL(TLS_URL);
    const env = {
      PGHOST: url.hostname,
      PGPORT: url.port,
      PGUSER: decodeURIComponent(url.username),
      PGDATABASE: url.pathname.slice(1),
      PGSSLMODE: 'verify-full',
      PGSSLROOTCERT: url.searchParams.get('sslrootcert'),
    };
    const saved = Object.fromEntries(Object.keys(env).map((k) => [k, process.env[k]]));
    Object.assign(process.env, env);
    try {
      const c = await OnceClient.connect(undefined, { onError: () => {} });
      try {
        const { rows: [row] } = await c.pool.query(SSL_OF, [c.ownerPid]);
        assert.equal(row.ssl, true);
      } finally {
        await c.end();
      }
      process.env.PGSSLROOTCERT = PUBLIC_ROOTS;
      if (existsSync(PUBLIC_ROOTS)) {
        await assert.rejects(OnceClient.connect(undefined, { connectTimeout: 1, onError: () => {} }), /certificate|verify/i);
      }
    } finally {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
    }
  });
});
