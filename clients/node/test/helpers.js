// Shared by the tests: the server setups to run against, clients whose claim_key calls
// are counted, child processes, and an admin connection.
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import readline from 'node:readline';
import pg from 'pg';
import { OnceClient } from '../src/index.mjs';
import hosts from '../src/hosts.cjs';

const { HostList, parseHosts, poolOptions } = hosts;

export const DSN = process.env.PG_ONCE_DSN;
export const BOUNCER_DSN = process.env.PG_ONCE_BOUNCER_DSN;
export const POOL_APP = 'pg-once-test-pool';

/**
 * The setups every test runs in: the pool straight to the server, and the pool through
 * PgBouncer in transaction mode with the listener straight to the server.
 */
export const setups = [
  DSN && { name: 'direct', poolDsn: DSN, listenDsn: DSN },
  DSN && BOUNCER_DSN && { name: 'pgbouncer', poolDsn: BOUNCER_DSN, listenDsn: DSN },
].filter(Boolean);

/**
 * A hot standby listed before the server itself, with target_session_attrs (read-write in
 * the key/value form, primary in the URL form; docs/clients.md, N7): only the conformance
 * scenarios that name the setup run there.
 */
export const standbyFirstSetups = [
  DSN && process.env.PG_ONCE_STANDBY_FIRST_DSN && {
    name: 'standby_first_kv', kind: 'standby_first', poolDsn: process.env.PG_ONCE_STANDBY_FIRST_DSN, listenDsn: process.env.PG_ONCE_STANDBY_FIRST_DSN,
  },
  DSN && process.env.PG_ONCE_STANDBY_FIRST_URL && {
    name: 'standby_first_url', kind: 'standby_first', poolDsn: process.env.PG_ONCE_STANDBY_FIRST_URL, listenDsn: process.env.PG_ONCE_STANDBY_FIRST_URL,
  },
].filter(Boolean);
if (!DSN) console.warn('PG_ONCE_DSN is not set: the tests that need a server are skipped');

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * `fn` as a computation that says when it has started: `started` resolves then, when its
 * call's claim is taken and committed. A test that needs another caller to find the key
 * running waits for it, where a sleep could be too short on a loaded machine.
 */
export function announced(fn) {
  let resolve;
  const started = new Promise((r) => { resolve = r; });
  return { started, compute: async (...args) => { resolve(); return fn(...args); } };
}
export const freshKey = (name) => `node-test/${name}/${randomUUID()}`;

/** A pg.Pool whose claim_key calls are counted per key (pool.claims.get(key)). */
export function countingPool(dsn, max = 4) {
  // A string naming several hosts (or a target, or in key/value form) is read as the
  // client's own OnceClient.connect reads it (N7).
  const hosts = parseHosts(dsn);
  const where = hosts ? poolOptions(pg, new HostList(hosts)) : { connectionString: dsn };
  const pool = new pg.Pool({ ...where, max, application_name: POOL_APP });
  pool.on('error', () => {}); // idle connections we terminate on purpose
  pool.claims = new Map();
  pool.statements = [];
  const query = pool.query.bind(pool);
  pool.query = (text, values, ...rest) => {
    if (typeof text === 'string') {
      pool.statements.push(text);
      if (text.includes('once.claim_key')) pool.claims.set(values[0], (pool.claims.get(values[0]) ?? 0) + 1);
    }
    return query(text, values, ...rest);
  };
  return pool;
}

/** A client for `setup` on its own counting pool (or `pool`); end with closeClient. */
export function makeClient(setup, { pool, poolSize = 4, ...options } = {}) {
  const p = pool ?? countingPool(setup.poolDsn, poolSize);
  const client = new OnceClient({
    pool: p, listenConnectionString: setup.listenDsn, onError: () => {}, ...options,
  });
  client.ownPool = !pool;
  return client;
}

export async function closeClient(client) {
  await client.end();
  if (client.ownPool) await client.pool.end();
}

export async function admin() {
  const c = new pg.Client({ connectionString: DSN, application_name: 'pg-once-test-admin' });
  await c.connect();
  return c;
}

/**
 * Close the pooled server connections under the clients' feet: terminate the backends of
 * the test pools (directly, or PgBouncer's) and, through PgBouncer, RECONNECT too.
 * Returns how many backends were terminated.
 */
export async function recyclePooledConnections(setup) {
  const a = await admin();
  try {
    const { rows } = await a.query(
      `SELECT count(*)::int AS n FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
        WHERE application_name = $1 AND pid <> pg_backend_pid()) t`, [POOL_APP]);
    if (setup.name === 'pgbouncer') {
      const url = new URL(setup.poolDsn);
      url.pathname = '/pgbouncer';
      const console = new pg.Client({ connectionString: url.toString() });
      await console.connect();
      await console.query('RECONNECT'); // simple protocol: the admin console takes nothing else
      await console.end();
    }
    return rows[0].n;
  } finally {
    await a.end();
  }
}

const CHILD = fileURLToPath(new URL('./child.js', import.meta.url));

/**
 * `node test/child.js MODE ARGS` for `setup`. Its stdout is JSON lines: `next(pred)`
 * resolves with the first (later) message matching pred; `exit` with the exit code.
 */
export function child(setup, mode, args) {
  const proc = spawn(process.execPath, [CHILD, mode, JSON.stringify(args)], {
    env: { ...process.env, CHILD_POOL_DSN: setup.poolDsn, CHILD_LISTEN_DSN: setup.listenDsn },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const messages = [];
  let waiters = [];
  readline.createInterface({ input: proc.stdout }).on('line', (line) => {
    const msg = JSON.parse(line);
    messages.push(msg);
    waiters = waiters.filter(({ pred, resolve }) => (pred(msg) ? (resolve(msg), false) : true));
  });
  const exit = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));
  return {
    proc,
    messages,
    exit,
    next(pred, timeoutMs = 15_000) {
      const seen = messages.find(pred);
      if (seen) return Promise.resolve(seen);
      return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`child ${mode}: no such message within ${timeoutMs} ms`)), timeoutMs);
        waiters.push({ pred, resolve: (m) => { clearTimeout(timer); resolve(m); } });
      });
    },
  };
}
