// OnceClient: compute each key once across every process that shares a database.
//
// The rules it follows are docs/clients.md, "What every client does". In short:
// - calls for one key in one process share one claim (#inflight);
// - a call that has to wait holds no pooled connection: it asks with claim_key(wait => 0)
//   and sleeps on the listener (or polls, with listen: false);
// - every statement is one autocommit call through the pool with an unnamed statement,
//   so a pool behind PgBouncer in transaction mode works;
// - claims name the listener connection as their owner (owner_pid), so they survive a
//   pooled connection being recycled and end within about a second if the process dies.
import pg from 'pg';
import { Listener } from './listener.js';
import { OnceFailed, OnceTimeout, OnceError } from './errors.js';
import {
  describeError, freshness, isConnectionError, jitter, seconds, sleep, toJson,
} from './util.js';
import { Worker } from './worker.js';
import {
  COMPLETE_FRESHNESS_SQL, COMPLETE_SQL, FAIL_SQL, Heartbeat, RELEASE_SQL,
} from './protocol.js';

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
                  AND 'serve_stale' = ANY (p.proargnames)) AS freshness`;

// serveStale: the caller asked for stale/beta, so it also takes the outcomes 'refresh' (ours
// to recompute, with the previous result to answer meanwhile) and 'stale' (the previous
// result, at once). Without them it sends exactly what pre-0.2 clients send.
const claimSql = (withOwner, serveStale) => `
SELECT outcome, token, result, error, lease_expires_at, retry_at
  FROM once.claim_key($1, lease => make_interval(secs => $2), wait => '0'${withOwner ? ', owner_pid => $3' : ''}${serveStale ? ', serve_stale => true' : ''})`;
/** Marks "nothing computed yet" (null and undefined are results). */
const NOTHING = Symbol('nothing');

const defaultOnError = (err) => console.warn(`pg-once: ${err?.message ?? err}`);

export class OnceClient {
  #pool;
  #ownsPool = false;
  #listener = null;
  #defaults;
  #onError;
  #capabilities = null; // Promise of the row of CAPABILITIES_SQL
  #caps = null; // the row, once known
  #inflight = new Map(); // key -> the promise every caller in this process awaits
  #refreshes = new Map(); // key -> the background refresh running here (at most one per key)
  #workers = new Set();
  #closed = false;

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
    connectTimeout = 10, onError = defaultOnError,
  } = {}) {
    if (!pool) throw new TypeError('pg-once: new OnceClient({ pool }) needs a pg.Pool (or use OnceClient.connect(url))');
    this.#pool = pool;
    this.#onError = onError;
    this.#defaults = this.#options({
      lease, wait, ttl, retryAfter, recheck, stale, beta, jitter,
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
      });
    }
  }

  /**
   * A client with its own pg.Pool on `connectionString` (ended by end()), connected and
   * listening before it returns. `poolSize` (default 10) is the pool's `max`.
   */
  static async connect(connectionString, { poolSize = 10, poolOptions = {}, ...options } = {}) {
    const pool = new pg.Pool({ connectionString, max: poolSize, ...poolOptions });
    const client = new OnceClient({ connectionString, ...options, pool });
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
   * The cached result of `key`, or compute it with `compute()` if nobody has, exactly
   * once across every process. Calls for one key in this process while one is running
   * share its outcome (and its options).
   */
  getOrCompute(key, compute, options = {}) {
    if (typeof key !== 'string' || key === '') {
      return Promise.reject(new TypeError('pg-once: key must be a non-empty string'));
    }
    if (typeof compute !== 'function') {
      return Promise.reject(new TypeError('pg-once: compute must be a function'));
    }
    if (this.#closed) return Promise.reject(new OnceError('pg-once: the client has been ended'));
    const running = this.#inflight.get(key);
    if (running) return running;
    let opts;
    try {
      opts = this.#options(options, this.#defaults);
    } catch (err) {
      return Promise.reject(err);
    }
    const call = this.#getOrCompute(key, compute, opts).finally(() => this.#inflight.delete(key));
    this.#inflight.set(key, call);
    return call;
  }

  /**
   * `fn` wrapped so that its result is cached: `key` is a function of fn's arguments
   * returning the key, or a prefix (default fn.name) followed by the arguments as JSON.
   */
  cached(fn, { key, ...options } = {}) {
    if (typeof fn !== 'function') throw new TypeError('pg-once: cached(fn) needs a function');
    let keyOf = key;
    if (typeof key !== 'function') {
      const prefix = key ?? fn.name;
      if (!prefix) throw new TypeError('pg-once: cached() of an anonymous function needs a key option');
      keyOf = (...args) => `${prefix}:${JSON.stringify(args)}`;
    }
    this.#options(options, this.#defaults); // refuse bad options now, not at the first call
    return (...args) => this.getOrCompute(keyOf(...args), () => fn(...args), options);
  }

  /**
   * Work a queue: claim up to `concurrency` keys at a time, run `handler(job)` on each,
   * complete or fail it. Returns a Worker: `await worker.stop()`, or `await worker.done`.
   */
  work(queue, handler, options = {}) {
    if (this.#closed) throw new OnceError('pg-once: the client has been ended');
    // The client's lease and ttl are the worker's defaults; retryAfter is not: a queue's
    // own backoff decides when a failed job runs again.
    const { lease, ttl } = this.#defaults;
    const worker = new Worker(queue, handler, { lease, ttl, ...options }, {
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
    worker.done.finally(() => this.#workers.delete(worker));
    return worker;
  }

  /**
   * Stop the workers (finishing or releasing their jobs), let background refreshes store
   * their results for up to `refreshTimeout` seconds and give back the claims of those still
   * running, then close the listener, and the pool if it is ours.
   */
  async end({ refreshTimeout = 10 } = {}) {
    if (this.#closed) return;
    seconds('refreshTimeout', refreshTimeout, { allowZero: true });
    this.#closed = true;
    await Promise.all([...[...this.#workers].map((w) => w.stop()), this.#endRefreshes(refreshTimeout)]);
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
    };
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
   * (up to twice) when the connection it went out on was closed under it: every pg_once
   * call is safe to repeat with the same token, and a recycled pooled connection is no
   * reason to fail the caller.
   */
  async #query(text, values) {
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await this.#pool.query(text, values);
      } catch (err) {
        if (attempt >= 3 || this.#closed || !isConnectionError(err)) throw err;
        await sleep(jitter(50 * attempt));
      }
    }
  }

  async #claim(key, lease, serveStale) {
    for (let retried = false; ; retried = true) {
      const owner = await this.#owner();
      try {
        const { rows: [claim] } = owner === null
          ? await this.#query(claimSql(false, false), [key, lease])
          : await this.#query(claimSql(true, serveStale), [key, lease, owner]);
        return claim;
      } catch (err) {
        // 22023 naming our owner pid: the listener connection died a moment ago and we
        // have not noticed yet. Check it (reconnecting), then claim with the new pid.
        if (retried || err.code !== '22023' || !owner) throw err;
        await this.#listener.verify(owner);
      }
    }
  }

  async #getOrCompute(key, compute, o) {
    const deadline = Date.now() + o.wait * 1000;
    const caps = await this.#loadCapabilities();
    if (o.freshness && !(caps.freshness && caps.claim_owner)) {
      throw new OnceError('pg-once: stale, beta and jitter need pg_once 0.2.0 or later on the server (ALTER EXTENSION pg_once UPDATE)');
    }
    // Interest first, claim second: a completion notified in between is not lost.
    const interest = this.#listener?.interest(key);
    let pollDelay = 50; // listen: false — 50 ms doubling to 1 s
    let computed = NOTHING; // a result computed under a claim that was then lost
    try {
      for (;;) {
        interest?.arm();
        const claim = await this.#claim(key, o.lease, o.serveStale);
        switch (claim.outcome) {
          case 'hit':
            return claim.result;
          case 'stale':
            // Someone refreshes it (or its last refresh failed): the previous result, never a wait.
            return claim.result;
          case 'refresh':
            // Ours to recompute; the previous result is the answer meanwhile.
            this.#refreshInBackground(key, claim.token, compute, o);
            return claim.result;
          case 'failed':
            throw new OnceFailed(key, claim.error, claim.retry_at);
          case 'claimed': {
            const done = await this.#computeClaimed(key, claim.token, compute, o, computed);
            if (done.stored) return done.value;
            // The claim was lost (its lease ran out and someone took over, or it was
            // invalidated): ask again. We get the new owner's result, or claim again and
            // store what we already computed instead of computing it twice.
            computed = done.json;
            continue;
          }
          case 'wait': {
            const now = Date.now();
            if (now >= deadline) throw new OnceTimeout(key, o.wait);
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
            await (interest ? interest.wait(pause) : sleep(pause));
            continue;
          }
          default:
            throw new OnceError(`pg-once: unexpected claim_key outcome ${claim.outcome} for ${key}`);
        }
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
   * back, as does one drawn while ending.
   */
  #refreshInBackground(key, token, compute, o) {
    if (this.#closed || this.#refreshes.has(key)) {
      this.#release(key, token);
      return;
    }
    const refresh = { key, token, abandoned: false, heartbeat: null };
    refresh.done = (async () => {
      try {
        const done = await this.#computeClaimed(key, token, compute, o, NOTHING, refresh);
        if (!done.stored && !refresh.abandoned) {
          this.#onError(new OnceError(`pg-once: the refresh of ${key} lost its claim; its result was not stored`));
        }
      } catch (err) {
        if (!refresh.abandoned) {
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
      r.abandoned = true;
      r.heartbeat?.stop();
      return this.#release(r.key, r.token);
    }));
  }

  /**
   * Run `compute` under the claim `token`, heartbeating, and store its result.
   * Returns { stored: true, value } or, when the claim was lost, { stored: false, json }.
   * `refresh`: the background refresh this is, whose claim end() may give back meanwhile.
   */
  async #computeClaimed(key, token, compute, o, precomputed, refresh = null) {
    const heartbeat = new Heartbeat((sql, params) => this.#query(sql, params), (err) => this.#onError(err), key, token, o.lease);
    if (refresh) refresh.heartbeat = heartbeat;
    let json = precomputed;
    try {
      if (json === NOTHING) {
        let value;
        try {
          value = await compute();
        } catch (err) {
          if (!refresh?.abandoned) await this.#fail(key, token, describeError(err), o.retryAfter);
          throw err;
        }
        try {
          json = toJson(key, value);
        } catch (err) {
          // Share the reason with the waiters rather than let each of them compute the
          // same unstorable value; it is retried after retryAfter like any failure.
          await this.#fail(key, token, describeError(err), o.retryAfter);
          throw err;
        }
      }
    } finally {
      heartbeat.stop();
    }
    if (heartbeat.lost || refresh?.abandoned) return { stored: false, json };
    let stored;
    try {
      ({ rows: [{ stored }] } = o.freshness
        ? await this.#query(COMPLETE_FRESHNESS_SQL, [key, token, json, o.ttl, o.stale, o.beta, o.jitter])
        : await this.#query(COMPLETE_SQL, [key, token, json, o.ttl]));
    } catch (err) {
      if (isConnectionError(err)) throw err; // nothing we can write: the lease ends the claim
      // The server refused the value (e.g. a \u0000 in a string, which jsonb cannot hold):
      // fail the key, so it is not left claimed, and say why.
      const error = new OnceError(`pg-once: the server refused the result for ${key}: ${err.message}`, { cause: err });
      await this.#fail(key, token, describeError(error), o.retryAfter);
      throw error;
    }
    if (!stored) return { stored: false, json };
    // Everyone else gets the result back from jsonb; the owner gets the same thing.
    return { stored: true, value: JSON.parse(json) };
  }

  /** Give a claim back (background refreshes only): the next caller takes the key at once. */
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
