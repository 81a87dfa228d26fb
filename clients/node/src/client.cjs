// OnceClient: compute each key once across every process that shares a database.
//
// The rules it follows are docs/clients.md's numbered rules (cited by number here). In short:
// - calls for one key in one process share one flight (#inflight: one claim, one
//   computation), each caller within its own wait and signal;
// - every caller reads deserialize(serialize(result)), the computing one included;
// - a call that has to wait holds no pooled connection: it asks with claim_key(wait => 0)
//   and sleeps on the listener (or polls, with listen: false);
// - every statement is one autocommit call through the pool with an unnamed statement,
//   so a pool behind PgBouncer in transaction mode works;
// - claims name the listener connection as their owner (owner_pid), so they survive a
//   pooled connection being recycled and end within about a second if the process dies.
'use strict';

const { readFileSync } = require('node:fs');
const pg = require('pg');
const { Listener } = require('./listener.cjs');
const {
  ClaimLost, ConfigurationError, OnceError, OnceFailed, OnceTimeout, ResultRefused,
} = require('./errors.cjs');
const { checkKey, defaultKey } = require('./keys.cjs');
const { serializer, toText } = require('./values.cjs');
const { Observation, OUTCOMES, tracingReady } = require('./observe.cjs');
const {
  bounded, describeError, freshness, isConnectionError, jitter, seconds, sleep,
} = require('./util.cjs');
const { Worker } = require('./worker.cjs');
const { Claim } = require('./claim.cjs');
const { HostList, parseHosts, poolOptions } = require('./hosts.cjs');
const {
  COMPLETE_FRESHNESS_SQL, COMPLETE_SQL, ENQUEUE_MANY_SQL, ENQUEUE_SQL, FAIL_SQL, Heartbeat, INVALIDATE_SQL, REFRESH_SQL, RELEASE_SQL,
} = require('./protocol.cjs');

// What the connected server supports. Servers from before owner_session() (and the
// owner_pid / claim_next wait arguments) still work: claims are then owned by the pooled
// connection that made them, and an idle worker polls.
const CAPABILITIES_SQL = `
SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'once') AS installed,
       EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'once' AND p.proname = 'owner_session') AS owner_session,
       EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'once' AND p.proname = 'claim_key'
                  AND 'owner_pid' = ANY (p.proargnames)) AS claim_owner,
       EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'once' AND p.proname = 'claim_next'
                  AND 'wait' = ANY (p.proargnames)) AS claim_next_wait,
       EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'once' AND p.proname = 'claim_key'
                  AND 'serve_stale' = ANY (p.proargnames)) AS freshness,
       EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'once' AND p.proname = 'claim_key'
                  AND 'fingerprint' = ANY (p.proargnames)) AS fingerprint`;

// serveStale: the caller asked for stale/beta, so it also takes the outcomes 'refresh' (ours
// to recompute, with the previous result to answer meanwhile) and 'stale' (the previous
// result, at once). Without them it sends exactly what pre-0.2 clients send.
// fingerprint (pg_once 0.3.0): the digest of the request a key stands for (rule I3); the
// server answers 'mismatch' to a caller whose digest differs. Sent only when given.
const claimSql = (withOwner, serveStale, fingerprint = false) => `
SELECT outcome, token, result::text AS result, error, lease_expires_at, retry_at
  FROM once.claim_key($1, lease => make_interval(secs => $2), wait => '0'${withOwner ? ', owner_pid => $3' : ''}${serveStale ? ', serve_stale => true' : ''}${fingerprint ? `, fingerprint => $${withOwner ? 4 : 3}::bytea` : ''})`;
/**
 * What a follower in this process gets when the flight it shares ended on its first
 * caller's `wait`: the follower asks again itself, within its own.
 */
const LEADER_GAVE_UP = Symbol('the leading call gave up');
/** Marks the OnceTimeout a call raised for its own wait. */
const OWN_DEADLINE = Symbol('own deadline');

/**
 * What node-postgres leaves out of libpq's environment (it reads PGHOST, PGPORT, PGUSER,
 * PGPASSWORD, PGDATABASE, PGSSLMODE...): PGSSLROOTCERT, the private CA to verify the
 * server with (and its host name, as sslrootcert in a connection string does).
 */
function sslFromEnvironment(env = process.env) {
  if (!env.PGSSLROOTCERT || env.PGSSLMODE === 'disable') return {};
  return { ssl: { ca: readFileSync(env.PGSSLROOTCERT, 'utf8') } };
}

const defaultOnError = (err) => console.warn(`pg-once: ${err?.message ?? err}`);

class OnceClient {
  #pool;
  #ownsPool = false;
  #listener = null;
  #defaults;
  #onError;
  #capabilities = null; // Promise of the row of CAPABILITIES_SQL
  #caps = null; // the row, once known
  #inflight = new Map(); // key -> the promise every caller in this process awaits
  #refreshes = new Map(); // key -> the background refresh running here (at most one per key)
  #lateClaims = new Set(); // claim_key answers whose callers left, released when they come
  #workers = new Set();
  #closed = false;
  #connectTimeoutMs;

  /**
   * @param {object} options
   * @param {pg.Pool} options.pool  the pool every call goes through (may be PgBouncer)
   * @param {string} [options.connectionString]  used for the listener when
   *   listenConnectionString is not given (default: the pool's own settings)
   * @param {string} [options.listenConnectionString]  the LISTEN/owner connection:
   *   direct or session-pooled, never transaction-pooled
   * @param {boolean} [options.listen=true]  false: no LISTEN connection; waiters poll and
   *   claims end only when their lease runs out (owner_pid => 0)
   */
  constructor({
    pool, connectionString, listenConnectionString, listen = true,
    lease = 30, wait = 30, ttl = null, retryAfter = 5, recheck = 1, stale = null, beta = null, jitter = null,
    serialize, deserialize, onOutcome = null, connectTimeout = 10, onError = defaultOnError,
  } = {}) {
    if (!pool) throw new TypeError('pg-once: new OnceClient({ pool }) needs a pg.Pool (or use OnceClient.connect(url))');
    this.#pool = pool;
    this.#onError = onError;
    this.#connectTimeoutMs = seconds('connectTimeout', connectTimeout) * 1000; // R2's budget
    this.#defaults = this.#options({
      lease, wait, ttl, retryAfter, recheck, stale, beta, jitter, serialize, deserialize, onOutcome,
    }, {});
    if (listen) {
      const config = listenConnectionString ? { connectionString: listenConnectionString }
        : connectionString ? { connectionString }
          : { ...pool.options }; // the pool's own settings (pg.Pool keeps them there)
      delete config.max; // pool-only settings mean nothing to a single client
      this.#listener = new Listener(config, {
        onError: (err) => this.#onError(err),
        ownerSession: () => Boolean(this.#caps?.owner_session),
        connectTimeout,
        notifyThroughPool: (payload) => this.#query("SELECT pg_notify('once', $1)", [payload]),
      });
    }
  }

  /**
   * A client with its own pg.Pool on `connectionString` (ended by end()), connected and
   * listening before it returns. `poolSize` (default 10) is the pool's `max`. Without a
   * connection string (or with ''), libpq's PG* environment variables say where to
   * connect. The string's (or PGSSLMODE's) sslmode and sslrootcert hold for the pool and
   * the LISTEN connection alike.
   */
  static async connect(connectionString, { poolSize = 10, poolOptions: extra = {}, ...options } = {}) {
    // Several hosts, or target_session_attrs, or libpq's key/value form: each pooled
    // connection on the first host that qualifies (N7, hosts.cjs).
    const hosts = parseHosts(connectionString);
    const where = hosts ? poolOptions(pg, new HostList(hosts))
      : connectionString ? { connectionString } : sslFromEnvironment();
    // Getting a pooled connection (waiting for a free one included) gives up after
    // connectTimeout, as the LISTEN connection does (docs/clients.md, N6).
    const connectionTimeoutMillis = (options.connectTimeout ?? 10) * 1000;
    const pool = new pg.Pool({ ...where, max: poolSize, connectionTimeoutMillis, ...extra });
    const client = new OnceClient({ connectionString: connectionString || undefined, ...options, pool });
    client.#ownsPool = true;
    // A pooled idle connection that the server or PgBouncer closes is an 'error' event
    // on the pool; unhandled, it would end the process. The pool replaces it anyway.
    pool.on('error', (err) => client.#onError(err));
    try {
      await client.ready();
    } catch (err) {
      await client.end().catch(() => {});
      throw err;
    }
    return client;
  }

  /** The pool every call goes through. */
  get pool() {
    return this.#pool;
  }

  /**
   * The pid that owns this process's claims: the listener's backend (0 with listen:
   * false; null while the listener reconnects or before ready()).
   */
  get ownerPid() {
    return this.#listener ? this.#listener.currentPid : 0;
  }

  /** Check the server and start the listener. Calls do this themselves when needed. */
  async ready() {
    await this.#loadCapabilities();
    await this.#owner();
  }

  /**
   * The cached result of `key`, or compute it with `compute({ signal })` if nobody has,
   * exactly once across every process. Calls for one key in this process while one is
   * running share its outcome, each within its own `wait` and `signal`.
   */
  getOrCompute(key, compute, options = {}) {
    let opts;
    try {
      checkKey(key);
      if (typeof compute !== 'function') throw new TypeError('pg-once: compute must be a function');
      if (this.#closed) throw new OnceError('pg-once: the client has been ended');
      opts = this.#options(options, this.#defaults);
    } catch (err) {
      return Promise.reject(err);
    }
    return this.#call(key, compute, opts);
  }

  /**
   * `fn` wrapped so that its result is cached. The key of a call is `key(...args)` if
   * given, else derived from `name` and the arguments (docs/clients.md, rule K; `name`
   * is required because a minifier renames functions). The wrapper has
   * `.invalidate(...args)` and `.refresh(...args)` for the key of those arguments.
   */
  cached(fn, { name, key, ...options } = {}) {
    if (typeof fn !== 'function') throw new TypeError('pg-once: cached(fn) needs a function');
    let keyOf;
    if (key !== undefined) {
      if (typeof key !== 'function') throw new TypeError('pg-once: cached(fn, { key }) takes a function of the arguments returning the key (for a fixed prefix, pass name)');
      keyOf = (...args) => checkKey(key(...args));
    } else {
      if (typeof name !== 'string' || name === '') {
        throw new TypeError('pg-once: cached(fn) needs a name (the prefix of its keys: fn.name is not stable under minifiers) or a key function');
      }
      keyOf = (...args) => defaultKey(name, args);
    }
    this.#options(options, this.#defaults); // refuse bad options now, not at the first call
    // Each takes fn's arguments; a key that cannot be derived rejects, like any call.
    const withKey = (f) => (...args) => {
      try {
        return f(keyOf(...args), args);
      } catch (err) {
        return Promise.reject(err);
      }
    };
    const wrapper = withKey((k, args) => this.getOrCompute(k, () => fn(...args), options));
    wrapper.invalidate = withKey((k) => this.invalidate(k));
    wrapper.refresh = withKey((k) => this.refresh(k, { stale: options.stale ?? this.#defaults.stale }));
    return wrapper;
  }

  /**
   * One claim_key for code that computes and stores by itself (the idempotency
   * middleware): `{ outcome: 'hit', result }` (the stored JSON value), `{ outcome:
   * 'claimed', claim }` (a Claim: heartbeated until its complete or release), `{ outcome:
   * 'mismatch' }` (the key runs or is served for another `fingerprint`), `{ outcome:
   * 'failed', error, retryAt }`, or `{ outcome: 'wait' }` when someone else still holds it
   * after `wait` seconds (default 0: ask once), waited for as getOrCompute waits (C2).
   * `fingerprint`: 1 to 64 bytes (pg_once 0.3.0), or null.
   */
  async claim(key, {
    lease = this.#defaults.lease, wait = 0, fingerprint = null, recheck = this.#defaults.recheck, signal,
  } = {}) {
    checkKey(key);
    if (this.#closed) throw new OnceError('pg-once: the client has been ended');
    const o = {
      lease: seconds('lease', lease),
      wait: seconds('wait', wait, { allowZero: true }),
      recheck: seconds('recheck', recheck),
      fingerprint: checkFingerprint(fingerprint),
      serveStale: false,
      signal,
    };
    if (signal !== undefined && !(signal instanceof AbortSignal)) throw new TypeError('pg-once: signal must be an AbortSignal');
    const caps = await this.#loadCapabilities();
    if (o.fingerprint !== null && !caps.fingerprint) {
      throw new ConfigurationError('pg-once: a fingerprint needs pg_once 0.3.0 or later on the server (ALTER EXTENSION pg_once UPDATE)');
    }
    const row = await this.#claimUntilAnswered(key, o, Date.now() + o.wait * 1000);
    switch (row.outcome) {
      case 'hit': return { outcome: 'hit', result: JSON.parse(row.result) };
      case 'claimed':
        return {
          outcome: 'claimed',
          claim: new Claim(key, row.token, o.lease, { query: (sql, params) => this.#query(sql, params), onError: (err) => this.#onError(err) }),
        };
      case 'failed': return { outcome: 'failed', error: row.error, retryAt: row.retry_at };
      case 'wait':
      case 'mismatch': return { outcome: row.outcome };
      default: throw new OnceError(`pg-once: unexpected claim_key outcome ${row.outcome} for ${key}`);
    }
  }

  /** Forget `key`'s result or failure (once.invalidate_key): false if it was absent. */
  async invalidate(key) {
    checkKey(key);
    const { rows: [{ invalidated }] } = await this.#query(INVALIDATE_SQL, [key]);
    return invalidated;
  }

  /**
   * Have `key` computed again without a second computation beside a running one
   * (once.refresh_key), its result served as stale for `stale` seconds meanwhile:
   * 'expired', 'rerun', 'pending' or 'absent'.
   */
  async refresh(key, { stale = null } = {}) {
    checkKey(key);
    const { rows: [{ refreshed }] } = await this.#query(REFRESH_SQL, [key, seconds('stale', stale, { allowZero: true, allowNull: true })]);
    return refreshed;
  }

  /**
   * Ask for `key` to be computed by `queue`'s workers (once.enqueue_key): 'queued',
   * 'requeued', 'duplicate' or 'cached'. `payload` is JSON, handed to the handler.
   */
  async enqueue(key, {
    payload = null, queue = 'default', priority = 0, runAt = null, refresh = false, maxAttempts = null,
  } = {}) {
    checkKey(key);
    const text = toText(key, payload, serializer());
    checkEnqueueOptions(priority, runAt, maxAttempts);
    const { rows: [{ enqueued }] } = await this.#query(ENQUEUE_SQL,
      [key, text, queue, priority, runAt?.toISOString() ?? null, Boolean(refresh), maxAttempts]);
    return enqueued;
  }

  /**
   * enqueue for many keys in one statement (once.enqueue_keys). `jobs`: keys, or
   * `{ key, payload }` objects. Resolves to a Map of each key to its outcome, in the order
   * given. Every key is checked, every payload serialized, before anything is sent; at most
   * 1,000 distinct keys a call (the server refuses more, or a repeated key, with 22023).
   */
  async enqueueMany(jobs, {
    queue = 'default', priority = 0, runAt = null, refresh = false, maxAttempts = null,
  } = {}) {
    if (typeof jobs === 'string' || jobs == null || typeof jobs[Symbol.iterator] !== 'function') {
      throw new TypeError('pg-once: enqueueMany takes an array of keys or of { key, payload }; for one key call enqueue');
    }
    const keys = [];
    const texts = [];
    for (const job of jobs) {
      const { key, payload = null } = typeof job === 'string' ? { key: job } : job;
      checkKey(key);
      keys.push(key);
      texts.push(toText(key, payload, serializer()));
    }
    checkEnqueueOptions(priority, runAt, maxAttempts);
    if (keys.length === 0) return new Map();
    const { rows } = await this.#query(ENQUEUE_MANY_SQL,
      [keys, texts, queue, priority, runAt?.toISOString() ?? null, Boolean(refresh), maxAttempts]);
    return new Map(rows.map((r) => [r.key, r.outcome]));
  }

  /**
   * Work a queue: claim up to `concurrency` keys at a time, run `handler(job)` on each,
   * complete or fail it. Returns a Worker: `await worker.stop()`, or `await worker.done`.
   */
  work(queue, handler, options = {}) {
    if (this.#closed) throw new OnceError('pg-once: the client has been ended');
    // The client's lease and ttl are the worker's defaults; retryAfter is not: a queue's
    // own backoff decides when a failed job runs again.
    const { lease, ttl, serializer: defaultSerializer } = this.#defaults;
    const worker = new Worker(queue, handler, { lease, ttl, serializer: defaultSerializer, ...options }, {
      query: (sql, params) => this.#query(sql, params),
      owner: () => this.#owner(),
      verifyOwner: async () => {
        const pid = this.#listener?.currentPid;
        if (pid) await this.#listener.verify(pid);
      },
      capabilities: () => this.#loadCapabilities(),
      onError: (err) => this.#onError(err),
    });
    this.#workers.add(worker);
    worker.done.catch(() => {}).finally(() => this.#workers.delete(worker));
    return worker;
  }

  /**
   * Stop the workers (finishing or releasing their jobs), let background refreshes store
   * their results for up to `refreshTimeout` seconds and give back the claims of those still
   * running, wait as long for the late claim_key answers whose callers left (#lateClaims),
   * then close the listener, and the pool if it is ours.
   */
  async end({ refreshTimeout = 10 } = {}) {
    if (this.#closed) return;
    seconds('refreshTimeout', refreshTimeout, { allowZero: true });
    this.#closed = true;
    await Promise.all([
      ...[...this.#workers].map((w) => w.stop().catch(() => {})),
      this.#endRefreshes(refreshTimeout),
      this.#endLateClaims(refreshTimeout),
    ]);
    await this.#listener?.close();
    if (this.#ownsPool) await this.#pool.end();
  }

  // ---------------------------------------------------------------------------------

  #options(o, d) {
    const pick = (name) => (o[name] === undefined ? d[name] : o[name]);
    const opts = {
      lease: seconds('lease', pick('lease')),
      wait: seconds('wait', pick('wait'), { allowZero: true }),
      ttl: seconds('ttl', pick('ttl'), { allowNull: true }),
      retryAfter: seconds('retryAfter', pick('retryAfter'), { allowZero: true }),
      recheck: seconds('recheck', pick('recheck')),
      ...freshness(pick('stale'), pick('beta'), pick('jitter')),
      serializer: o.serialize === undefined && o.deserialize === undefined ? d.serializer ?? serializer() : serializer(o),
      signal: o.signal,
      onOutcome: pick('onOutcome'),
    };
    if (opts.signal !== undefined && !(opts.signal instanceof AbortSignal)) {
      throw new TypeError('pg-once: signal must be an AbortSignal');
    }
    if (opts.onOutcome != null && typeof opts.onOutcome !== 'function') {
      throw new TypeError(`pg-once: onOutcome must be a function called with { kind (${OUTCOMES.join(', ')}), key, duration, error }`);
    }
    if (opts.freshness && opts.ttl === null) {
      throw new TypeError('pg-once: stale, beta and jitter need a ttl: they say what happens around the result\'s expiry, and without a ttl it never expires');
    }
    return opts;
  }

  #loadCapabilities() {
    this.#capabilities ??= this.#query(CAPABILITIES_SQL).then(({ rows: [caps] }) => {
      if (!caps.installed) {
        throw new OnceError('pg-once: the pg_once extension is not installed in this database (CREATE EXTENSION pg_once)');
      }
      this.#caps = caps;
      if (!caps.owner_session) {
        this.#onError(new OnceError('pg-once: the server has no once.owner_session() (pg_once before 0.2.0): claims belong '
          + 'to the pooled connection that made them, and a recycled connection loses them (ALTER EXTENSION pg_once UPDATE)'));
      }
      return caps;
    }, (err) => {
      this.#capabilities = null; // try again on the next call
      throw err;
    });
    return this.#capabilities;
  }

  /** The owner_pid to claim with: the listener's pid, 0 (lease only), or null (server too old to take one). */
  async #owner() {
    const caps = await this.#loadCapabilities();
    if (!caps.claim_owner) {
      if (this.#listener) await this.#listener.ownerPid(); // still LISTEN for wake-ups
      return null;
    }
    return this.#listener ? this.#listener.ownerPid() : 0;
  }

  /**
   * One statement through the pool, in autocommit, as an unnamed statement. Sent again
   * on another connection when the one it went out on failed (docs/clients.md, R1, R2):
   * at once, then after jittered pauses of 50 ms doubling to 1 s, until `deadline` (ms
   * since the epoch: a claim's wait) or, without one, connectTimeout from now. Every
   * pg_once call is safe to repeat with the same token, and a recycled pooled connection,
   * or a failover to another host (N7), is no reason to fail the caller while the budget
   * lasts. A pooled connection that failed is not lent again: pg.Pool drops a client
   * whose query failed on a broken connection. `progress.failed` is kept at the last
   * connection error, for a caller that stops waiting for the statement at its deadline
   * (#claimWithin): R2 gives it that error.
   */
  async #query(text, values, deadline = Date.now() + this.#connectTimeoutMs, progress = {}) {
    let pause = 50;
    let failed = null;
    for (let attempt = 1; ; attempt += 1) {
      try {
        return failed === null ? await this.#pool.query(text, values) : await this.#retry(text, values, deadline, failed);
      } catch (err) {
        if (this.#closed || !isConnectionError(err)) throw err;
        progress.failed = err;
        if (attempt > 1) {
          const wait = jitter(pause);
          if (Date.now() + wait >= deadline) throw err;
          await sleep(wait);
          pause = Math.min(pause * 2, 1000);
        }
        failed = err;
      }
    }
  }

  /**
   * A retry of #query: as pool.query, but its wait for a pooled connection ends at
   * `deadline` (R2), when it fails with the error it retries (`failed`); a connection that
   * arrives later goes back to the pool.
   */
  async #retry(text, values, deadline, failed) {
    // A pause that a loaded machine stretched past the deadline starts no attempt (R2).
    if (Date.now() >= deadline) throw failed;
    const pending = this.#pool.connect();
    let client;
    try {
      client = await bounded(pending, { ms: deadline - Date.now(), onTimeout: () => failed });
    } catch (err) {
      pending.then((late) => late.release(), () => {});
      throw err;
    }
    // A connection that ends also emits 'error' on its client, besides failing the query:
    // pool.query listens for it, and so must we while the client is ours, or the process
    // gets an uncaught exception (a failover in a loaded test run did). The query's rejection
    // carries the error. (A pool other than pg's may lend clients that emit nothing.)
    const ended = () => {};
    client.on?.('error', ended);
    let result;
    try {
      result = await client.query(text, values);
    } catch (err) {
      client.removeListener?.('error', ended);
      client.release(err); // as pool.query does: a client whose query failed is not lent again
      throw err;
    }
    client.removeListener?.('error', ended);
    client.release();
    return result;
  }

  /**
   * One claim_key. `left` (a signal) aborts when its caller stopped waiting for it before it
   * was sent (while the owner pid was awaited): then nothing is sent, and it answers null.
   * `progress`: #query's.
   */
  async #claim(key, lease, serveStale, fingerprint = null, deadline = undefined, left = undefined, progress = {}) {
    const fp = fingerprint === null ? [] : [fingerprint];
    for (let retried = false; ; retried = true) {
      const owner = await this.#owner();
      if (left?.aborted) return null;
      try {
        const { rows: [claim] } = owner === null
          ? await this.#query(claimSql(false, false, fp.length > 0), [key, lease, ...fp], deadline, progress)
          : await this.#query(claimSql(true, serveStale, fp.length > 0), [key, lease, owner, ...fp], deadline, progress);
        return claim;
      } catch (err) {
        // 22023 naming our owner pid: the listener connection died a moment ago and we
        // have not noticed yet. Check it (reconnecting), then claim with the new pid.
        if (retried || err.code !== '22023' || !owner) throw err;
        await this.#listener.verify(owner);
      }
    }
  }

  /**
   * #claim within its caller's bounds (X2, N6, R2): it rejects as soon as `o.signal` aborts,
   * and, for a caller with a wait, with its Timeout at `deadline`, even while the statement
   * is on its way. That statement is not abandoned: a claim_key already sent may have
   * claimed the key for us, and nobody else could give that claim back before its lease
   * runs out. Its answer is taken when it comes, and a claim it made is released.
   * A call with wait 0, or whose deadline passed before its first ask (a loaded machine),
   * waits for that answer up to connectTimeout, R2's budget for every other statement:
   * bounding it by a deadline already gone would make the call fail without a chance.
   * A claim whose connection failed on the way and that is still being retried at the
   * deadline gives the caller that connection error, as R2 says, rather than Timeout.
   */
  #claimWithin(key, o, deadline) {
    const left = new AbortController();
    const progress = { failed: null };
    const answer = this.#claim(key, o.lease, o.serveStale, o.fingerprint ?? null, deadline, left.signal, progress);
    let timedOut = null;
    const bounds = { signal: o.signal };
    const remaining = deadline - Date.now();
    bounds.ms = o.wait > 0 && remaining > 0 ? remaining : this.#connectTimeoutMs;
    bounds.onTimeout = () => {
      timedOut = progress.failed ?? Object.assign(new OnceTimeout(key, o.wait), { [OWN_DEADLINE]: true });
      return timedOut;
    };
    return bounded(answer, bounds).catch((err) => {
      const gaveUp = err === timedOut || (o.signal?.aborted && err === o.signal.reason);
      if (gaveUp) {
        left.abort();
        this.#releaseWhenAnswered(key, answer);
      }
      throw err;
    });
  }

  /**
   * The answer of a claim_key whose caller has left: a claim it made ('claimed', or
   * 'refresh', C5) is released when it comes. end() waits for these (#endLateClaims).
   */
  #releaseWhenAnswered(key, answer) {
    const late = answer.then(async (row) => {
      if (row?.outcome === 'claimed' || row?.outcome === 'refresh') await this.#release(key, row.token);
    }, () => {}) // a claim_key that failed: its error was nobody's any more, and it gave us no token
      .finally(() => this.#lateClaims.delete(late));
    this.#lateClaims.add(late);
  }

  /** end(): wait up to `timeout` seconds for the answers of claims whose callers left. */
  async #endLateClaims(timeout) {
    if (this.#lateClaims.size === 0) return;
    let timer;
    await Promise.race([
      Promise.all(this.#lateClaims),
      new Promise((resolve) => { timer = setTimeout(resolve, timeout * 1000); }),
    ]);
    clearTimeout(timer);
    if (this.#lateClaims.size > 0) {
      this.#onError(new OnceError(`pg-once: ending: ${this.#lateClaims.size} claim_key answer(s) still on their way after ${timeout} s; a claim they made ends with its lease`));
    }
  }

  /**
   * One caller's call. The first call for `key` in this process starts a flight (claim,
   * compute or wait) bounded by its own `wait`; later ones follow it, each within its own
   * `wait` and `signal`. The flight is cancelled (its claim given back) only when every
   * caller on it has given up. A follower whose flight ended on the first caller's `wait`
   * asks again itself.
   */
  async #call(key, compute, o) {
    const deadline = Date.now() + o.wait * 1000;
    await tracingReady();
    const running = this.#inflight.get(key);
    const observed = new Observation(key, o.onOutcome, this.#onError, running?.observed.span ? [running.observed.span.spanContext()] : []);
    try {
      for (;;) {
        const flight = this.#inflight.get(key);
        if (!flight) {
          const mine = this.#startFlight(key, compute, o, deadline, observed);
          const value = await this.#attach(mine, o);
          observed.end(mine.kind);
          return value;
        }
        try {
          const value = await this.#attach(flight, o, deadline);
          observed.end('coalesced');
          return value;
        } catch (err) {
          if (err !== LEADER_GAVE_UP) throw err;
        }
      }
    } catch (err) {
      observed.end('failed', err);
      throw err;
    }
  }

  #startFlight(key, compute, o, deadline, observed) {
    const cancel = new AbortController();
    const flight = {
      key, callers: 0, cancel, settled: false, observed, kind: null, waited: false,
    };
    flight.run = this.#getOrCompute(key, compute, { ...o, signal: cancel.signal, observed }, deadline, flight);
    flight.shared = flight.run.catch((err) => {
      throw err?.[OWN_DEADLINE] ? LEADER_GAVE_UP : err;
    });
    flight.shared.catch(() => {}); // followers may never come
    const forget = () => {
      flight.settled = true;
      if (this.#inflight.get(key) === flight) this.#inflight.delete(key);
    };
    flight.run.then(forget, forget);
    this.#inflight.set(key, flight);
    return flight;
  }

  /**
   * Await `flight` within the caller's signal and, for a follower, its deadline (the
   * first caller's deadline is the flight's own). The last caller to give up cancels it.
   */
  async #attach(flight, o, deadline) {
    flight.callers += 1;
    let reason;
    try {
      if (deadline === undefined) return await bounded(flight.run, { signal: o.signal });
      return await bounded(flight.shared, {
        signal: o.signal,
        ms: deadline - Date.now(),
        onTimeout: () => new OnceTimeout(flight.key, o.wait),
      });
    } catch (err) {
      reason = err;
      throw err;
    } finally {
      flight.callers -= 1;
      if (flight.callers === 0 && !flight.settled) {
        // Every caller gave up (its signal or its wait): nobody wants the result any more.
        if (this.#inflight.get(flight.key) === flight) this.#inflight.delete(flight.key);
        flight.cancel.abort(reason);
      }
    }
  }

  /** Claim, compute or wait for `key`; records in `flight` how it went (kind, waited). */
  async #getOrCompute(key, compute, o, deadline, flight) {
    const caps = await this.#loadCapabilities();
    if (o.freshness && !(caps.freshness && caps.claim_owner)) {
      throw new ConfigurationError('pg-once: stale, beta and jitter need pg_once 0.2.0 or later on the server (ALTER EXTENSION pg_once UPDATE)');
    }
    const claim = await this.#claimUntilAnswered(key, o, deadline, () => { flight.waited = true; });
    switch (claim.outcome) {
      case 'hit':
      case 'stale': // someone refreshes it (or its last refresh failed): the previous result, never a wait
        flight.kind = claim.outcome === 'hit' && flight.waited ? 'waited' : claim.outcome;
        return o.serializer.deserialize(claim.result);
      case 'refresh':
        // Ours to recompute; the previous result is the answer meanwhile.
        this.#refreshInBackground(key, claim.token, compute, o);
        flight.kind = 'refresh';
        return o.serializer.deserialize(claim.result);
      case 'failed':
        throw new OnceFailed(key, claim.error, claim.retry_at);
      case 'claimed':
        flight.kind = 'claimed';
        return this.#computeClaimed(key, claim.token, compute, o);
      case 'wait':
        throw Object.assign(new OnceTimeout(key, o.wait), { [OWN_DEADLINE]: true });
      default:
        throw new OnceError(`pg-once: unexpected claim_key outcome ${claim.outcome} for ${key}`);
    }
  }

  /**
   * claim_key (wait => 0) until it answers anything but 'wait', or `deadline` passes (then
   * that last 'wait'), sleeping between asks as rule C2 says: on the LISTEN connection
   * until the key is notified, the owner's lease runs out or a jittered recheck passes
   * (with listen: false, polling 50 ms doubling to 1 s), holding no pooled connection.
   * `onWait` is told each time someone else holds the key.
   */
  async #claimUntilAnswered(key, o, deadline, onWait = () => {}) {
    // Interest first, claim second: a completion notified in between is not lost.
    const interest = this.#listener?.interest(key);
    let pollDelay = 50; // listen: false — 50 ms doubling to 1 s
    try {
      for (;;) {
        o.signal?.throwIfAborted();
        interest?.arm();
        const claim = await this.#claimWithin(key, o, deadline);
        if (claim.outcome !== 'wait') return claim;
        onWait();
        // claim.token is NULL here (or, from older servers, the owner's): never used.
        const now = Date.now();
        if (now >= deadline) return claim;
        let pause;
        if (interest) {
          pause = jitter(o.recheck * 1000);
        } else {
          pause = jitter(pollDelay);
          pollDelay = Math.min(pollDelay * 2, 1000);
        }
        // Ask again right after the owner's lease runs out: a stuck owner is taken over
        // then. (A lease already past by our clock is clock skew: keep the pause.)
        const leaseLeft = new Date(claim.lease_expires_at).getTime() - now + 20;
        if (leaseLeft > 0) pause = Math.min(pause, leaseLeft);
        pause = Math.min(pause, deadline - now);
        await bounded(interest ? interest.wait(pause) : sleep(pause), { signal: o.signal });
      }
    } finally {
      interest?.dispose();
    }
  }

  /**
   * Recompute `key` under the 'refresh' claim `token` in a detached promise while callers
   * are answered with the previous result. At most one runs per key in this process: a
   * refresh of this key still running here means the server no longer counts its claim (it
   * would have answered 'stale'), so its result will be refused; this claim then goes
   * back, as does one drawn while ending. The caller's signal does not stop it.
   */
  #refreshInBackground(key, token, compute, o) {
    if (this.#closed || this.#refreshes.has(key)) {
      this.#release(key, token);
      return;
    }
    const abandon = new AbortController(); // end() gives up on it
    const refresh = { key, abandon };
    refresh.done = (async () => {
      try {
        await this.#computeClaimed(key, token, compute, { ...o, signal: abandon.signal });
      } catch (err) {
        if (!abandon.signal.aborted) {
          this.#onError(new OnceError(`pg-once: refreshing ${key} failed; the previous result is still served until its stale window ends: ${err?.message ?? err}`, { cause: err }));
        }
      } finally {
        if (this.#refreshes.get(key) === refresh) this.#refreshes.delete(key);
      }
    })();
    this.#refreshes.set(key, refresh);
  }

  /** end(): wait up to `timeout` seconds for the refreshes running here, give back the rest. */
  async #endRefreshes(timeout) {
    const running = [...this.#refreshes.values()];
    if (running.length === 0) return;
    let timer;
    await Promise.race([
      Promise.all(running.map((r) => r.done)),
      new Promise((resolve) => { timer = setTimeout(resolve, timeout * 1000); }),
    ]);
    clearTimeout(timer);
    await Promise.all(running.filter((r) => this.#refreshes.get(r.key) === r).map((r) => {
      this.#onError(new OnceError(`pg-once: ending: the refresh of ${r.key} is still running after ${timeout} s; its claim is given back`));
      r.abandon.abort(new OnceError('pg-once: the client is ending'));
      return r.done; // computeClaimed gives the claim back
    }));
  }

  /**
   * Run `compute` under the claim `token`, heartbeating, store its result and return
   * what every other caller will read: deserialize(serialize(value)). Throws ClaimLost
   * when the claim ends first (compute's signal aborts then too); gives the claim back
   * and throws the reason when `o.signal` aborts; otherwise a failure is recorded with
   * fail_key, so the waiters share it rather than compute it again.
   */
  async #computeClaimed(key, token, compute, o) {
    const stop = new AbortController(); // compute's signal: the caller cancelled, or the claim was lost
    const heartbeat = new Heartbeat((sql, params) => this.#query(sql, params), (err) => this.#onError(err),
      key, token, o.lease, () => stop.abort(new ClaimLost(key)));
    const cancel = () => stop.abort(o.signal.reason);
    o.signal?.addEventListener('abort', cancel, { once: true });
    let text;
    try {
      if (o.signal?.aborted) {
        // Every caller left as the claim came: nobody wants the result, so compute nothing.
        await this.#release(key, token);
        throw o.signal.reason;
      }
      const running = Promise.resolve().then(() => o.observed.inSpan(() => compute({ signal: stop.signal })));
      running.catch(() => {}); // it may settle after we stopped waiting for it
      let value;
      try {
        value = await bounded(running, { signal: stop.signal });
      } catch (err) {
        if (stop.signal.aborted && err === stop.signal.reason) {
          // Lost: nothing of ours to write. Cancelled: the next caller takes the key at once.
          if (!(err instanceof ClaimLost)) await this.#release(key, token);
          throw err;
        }
        await this.#fail(key, token, describeError(err), o.retryAfter);
        throw err;
      }
      try {
        text = toText(key, value, o.serializer);
      } catch (err) {
        // Shared with the waiters rather than computed again by each of them.
        await this.#fail(key, token, describeError(err), o.retryAfter);
        throw err;
      }
    } finally {
      heartbeat.stop();
      o.signal?.removeEventListener('abort', cancel);
    }
    let stored;
    try {
      ({ rows: [{ stored }] } = o.freshness
        ? await this.#query(COMPLETE_FRESHNESS_SQL, [key, token, text, o.ttl, o.stale, o.beta, o.jitter])
        : await this.#query(COMPLETE_SQL, [key, token, text, o.ttl]));
    } catch (err) {
      if (isConnectionError(err)) throw err; // nothing we can write: the lease ends the claim
      // Refused (54000 too large, a \u0000 jsonb cannot hold, text that is not JSON):
      // failed, so that the waiters get the same error instead of computing it again.
      await this.#fail(key, token, `${err.code ?? 'no SQLSTATE'}: ${err.message}`, o.retryAfter);
      throw new ResultRefused(key, err);
    }
    if (!stored) throw new ClaimLost(key);
    return o.serializer.deserialize(text);
  }

  /** Give a claim back: the next caller takes the key at once. */
  async #release(key, token) {
    try {
      await this.#query(RELEASE_SQL, [key, token]);
    } catch (err) {
      this.#onError(new OnceError(`pg-once: could not give back the claim on ${key}: ${err.message}`, { cause: err }));
    }
  }

  async #fail(key, token, text, retryAfter) {
    try {
      await this.#query(FAIL_SQL, [key, token, text, retryAfter]);
    } catch (err) {
      // The caller gets the original error; the claim ends with its lease (or our process).
      this.#onError(new OnceError(`pg-once: could not record the failure of ${key}: ${err.message}`, { cause: err }));
    }
  }

}

/** A claim's fingerprint: null, or 1 to 64 bytes (the server's bounds, refused before any call). */
function checkFingerprint(fingerprint) {
  if (fingerprint === null || fingerprint === undefined) return null;
  if (!(fingerprint instanceof Uint8Array) || fingerprint.length < 1 || fingerprint.length > 64) {
    throw new TypeError(`pg-once: a fingerprint is 1 to 64 bytes (a Buffer or Uint8Array, e.g. a SHA-256 digest) or null, got ${
      fingerprint instanceof Uint8Array ? `${fingerprint.length} bytes` : typeof fingerprint}`);
  }
  return Buffer.from(fingerprint.buffer, fingerprint.byteOffset, fingerprint.length);
}

function checkEnqueueOptions(priority, runAt, maxAttempts) {
  if (!Number.isInteger(priority)) throw new TypeError(`pg-once: priority must be an integer, got ${priority}`);
  if (maxAttempts !== null && !(Number.isInteger(maxAttempts) && maxAttempts > 0)) {
    throw new TypeError(`pg-once: maxAttempts must be a positive integer, got ${maxAttempts}`);
  }
  if (runAt !== null && !(runAt instanceof Date && !Number.isNaN(runAt.getTime()))) {
    throw new TypeError('pg-once: runAt must be a valid Date');
  }
}

module.exports = { OnceClient };
