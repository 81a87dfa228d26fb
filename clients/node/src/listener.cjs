// The process's one LISTEN connection.
//
// It does two jobs (docs/clients.md):
// - it LISTENs on channel "once", where every key that stops running is notified with the
//   key (or, in a namespace, its digest: notifiedNames) as the payload, and wakes this
//   process's waiters for that key: a waiting call
//   holds no pooled connection, only an entry in `#interests`;
// - it is the owner of this process's claims: `once.owner_session()` names it, and its
//   pid P goes with every claim_key / claim_next, so the claims end when this process
//   (and so this connection) dies, and not when a pooled server connection is recycled.
//
// It must be a direct or session-pooled connection: under transaction pooling neither
// LISTEN nor a session's pid means anything.
'use strict';

const { createHash, randomUUID } = require('node:crypto');
const pg = require('pg');
const { ConfigurationError, OnceError } = require('./errors.cjs');
const { bounded, jitter, sleep } = require('./util.cjs');
const { HostList, parseHosts } = require('./hosts.cjs');

/**
 * What channel "once" may carry when `key` resolves: the key itself, or, for a key in a
 * namespace created with notify => 'digest' (the default there), its hex SHA-256,
 * encode(once.key_hash(key), 'hex'). A waiter listens for both.
 */
function notifiedNames(key) {
  return [key, createHash('sha256').update(key, 'utf8').digest('hex')];
}

/** One waiting call's interest in one key. Armed before each claim_key call. */
class Interest {
  #notified = false;
  #wake = null;

  /** Forget earlier notifications: called just before asking the server again. */
  arm() {
    this.#notified = false;
  }

  notify() {
    this.#notified = true;
    this.#wake?.();
  }

  /**
   * Sleep until notified (since the last arm()) or for `ms`. A notification that arrived
   * between arm() and this call returns at once: that is why interest is registered
   * before claim_key and not after it said "wait".
   */
  wait(ms) {
    if (this.#notified) return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.#wake = null;
        resolve();
      };
      const timer = setTimeout(done, ms);
      this.#wake = done;
    });
  }
}

const IDLE_CHECK_MS = 5000;

class Listener {
  #config;
  #hosts = null; // a HostList when the connection string names several hosts or a target
  #onError;
  #ownerSession; // () => boolean: whether the server has once.owner_session()
  #connectTimeoutMs;
  #client = null;
  #pid = null;
  #connecting = null;
  #refused = null;
  #closed = false;
  /** key -> Set<Interest> */
  #interests = new Map();

  #notifyThroughPool; // (payload) => Promise: NOTIFY once, payload, sent through the pool
  #probes = new Map(); // probe payload -> resolve

  constructor(config, {
    onError, ownerSession, connectTimeout = 10, notifyThroughPool = null,
  }) {
    this.#notifyThroughPool = notifyThroughPool;
    // keepAlive: a listener whose network silently died would otherwise never notice,
    // and this process's waiters would only ever wake on their rechecks.
    this.#config = { keepAlive: true, application_name: 'pg-once listener', ...config };
    // Several hosts (N7): the LISTEN connection goes to the first that qualifies, tried in
    // order at each (re)connection; the pool's own list when it is the client's.
    const { hostList, Client, onConnect, ...rest } = this.#config;
    const parsed = parseHosts(rest.connectionString);
    this.#hosts = parsed ? new HostList(parsed) : hostList ?? null;
    if (this.#hosts) {
      delete rest.connectionString;
      rest.connectionTimeoutMillis = connectTimeout * 1000; // each host's attempt (N7)
    }
    this.#config = rest;
    this.#onError = onError;
    this.#ownerSession = ownerSession;
    this.#connectTimeoutMs = connectTimeout * 1000;
  }

  /** The pid of the current listener connection (connecting first if there is none). */
  async ownerPid() {
    if (this.#client && this.#pid !== null) return this.#pid;
    return this.#connect();
  }

  /** The current pid, or null while (re)connecting. */
  get currentPid() {
    return this.#client ? this.#pid : null;
  }

  /**
   * The server refused `pid` as an owner: make sure the connection it names is still
   * ours and alive (a dead socket is not always noticed at once), reconnecting if not.
   */
  async verify(pid) {
    const client = this.#client;
    if (!client || this.#pid !== pid) return;
    try {
      await client.query('SELECT 1');
    } catch (err) {
      this.#lost(client, err);
    }
  }

  /** Register interest in `key`; call dispose() when the call is over. */
  interest(key) {
    const interest = new Interest();
    const sets = notifiedNames(key).map((name) => {
      let set = this.#interests.get(name);
      if (!set) this.#interests.set(name, (set = new Set()));
      set.add(interest);
      return [name, set];
    });
    interest.dispose = () => {
      for (const [name, set] of sets) {
        set.delete(interest);
        if (set.size === 0 && this.#interests.get(name) === set) this.#interests.delete(name);
      }
    };
    return interest;
  }

  async close() {
    this.#closed = true;
    const client = this.#client;
    this.#client = null;
    this.#wakeAll();
    if (client) await client.end().catch(() => {});
  }

  #connect() {
    // A configuration the LISTEN connection was refused for (N5: a transaction pooler)
    // does not change while the process runs: every later call is refused at once, as
    // Python's client refuses in its constructor, rather than probing for 2 s again.
    if (this.#refused) return Promise.reject(this.#refused);
    this.#connecting ??= this.#connectWithRetry().finally(() => {
      this.#connecting = null;
    });
    return this.#connecting;
  }

  async #connectWithRetry() {
    const deadline = Date.now() + this.#connectTimeoutMs;
    let delay = 50; // doubling to 2 s (docs/clients.md, N4)
    for (;;) {
      if (this.#closed) throw new OnceError('pg-once: the client has been ended');
      try {
        return await this.#connectOnce();
      } catch (err) {
        if (err instanceof ConfigurationError) {
          this.#refused = err; // trying again will not help
          throw err;
        }
        // A server that is restarting comes back; wrong credentials or a wrong host name
        // do not, but they fail fast anyway, so the same deadline serves both.
        if (Date.now() + delay > deadline) throw err;
        await sleep(jitter(delay));
        delay = Math.min(delay * 2, 2000);
      }
    }
  }

  async #connectOnce() {
    let client;
    const make = (config) => {
      const c = new pg.Client(config);
      // Attached before connect(): an unhandled 'error' event would end the process.
      c.on('error', (err) => this.#lost(c, err));
      c.on('end', () => this.#lost(c, null));
      c.on('notification', (msg) => {
        if (msg.channel === 'once') this.#notified(msg.payload);
      });
      return c;
    };
    let pid;
    try {
      if (this.#hosts) {
        client = await this.#hosts.connect(this.#config, make);
      } else {
        client = make(this.#config);
        await client.connect();
      }
      // LISTEN before anyone can claim with this pid: from now on no completion is lost.
      await client.query('LISTEN once');
      const sql = this.#ownerSession()
        ? 'SELECT once.owner_session() AS pid'
        : 'SELECT pg_backend_pid() AS pid'; // a server without owner_session(): pid unused
      pid = Number((await client.query(sql)).rows[0].pid);
      await this.#refuseTransactionPooler(client, sql, pid);
    } catch (err) {
      client?.end().catch(() => {});
      throw err;
    }
    if (this.#closed) {
      client.end().catch(() => {});
      throw new OnceError('pg-once: the client has been ended');
    }
    this.#client = client;
    this.#pid = pid;
    this.#checkWhileIdle(client);
    // Whatever was notified while there was no listener is lost: every waiter re-checks.
    this.#wakeAll();
    return pid;
  }

  /**
   * A LISTEN connection through a transaction pooler hears nothing (docs/clients.md, N5),
   * and every waiter would fall back to its recheck: refuse it. The pid the protocol
   * reported at connect (node-postgres' processID) equals the server's on a direct
   * connection. Otherwise a proxy sits between: a second statement on another backend is a
   * transaction pooler; the same backend proves nothing (a quiet pooler hands it back), so
   * a NOTIFY sent through the pool must reach this connection within 2 s.
   */
  async #refuseTransactionPooler(client, sql, pid) {
    if (client.processID === pid) return;
    const again = Number((await client.query(sql)).rows[0].pid);
    let heard = again === pid;
    if (heard && this.#notifyThroughPool) {
      const payload = `pg_once-probe:${randomUUID()}`;
      heard = await new Promise((resolve) => {
        const timer = setTimeout(() => resolve(false), 2000);
        this.#probes.set(payload, () => {
          clearTimeout(timer);
          resolve(true);
        });
        this.#notifyThroughPool(payload).catch(() => {}); // unsent: not heard, refused below
      });
      this.#probes.delete(payload);
    }
    if (!heard) {
      throw new ConfigurationError('pg-once: the LISTEN connection goes through a transaction pooler (its statements '
        + 'run on different server connections, or it hears no notification): waiters would never be woken and claims '
        + 'would not end with this process. Pass listenConnectionString, a direct or session-pooled connection string.');
    }
  }

  /**
   * A query every 5 s on the idle connection, answered within 5 s: a LISTEN connection
   * whose network died silently notices nothing otherwise (TCP keepalive takes minutes),
   * and meanwhile its waiters' wake-ups would be lost without a word.
   */
  #checkWhileIdle(client) {
    const timer = setInterval(() => {
      if (client !== this.#client) {
        clearInterval(timer);
        return;
      }
      bounded(client.query('SELECT 1'), {
        ms: IDLE_CHECK_MS,
        onTimeout: () => new OnceError(`no answer to a check within ${IDLE_CHECK_MS / 1000} s`),
      }).catch((err) => this.#lost(client, err));
    }, IDLE_CHECK_MS);
    timer.unref(); // never what keeps the process alive
  }

  #lost(client, err) {
    if (client !== this.#client) return; // a connection we already gave up on, or one still connecting
    this.#client = null;
    this.#pid = null;
    client.end().catch(() => {});
    if (this.#closed) return;
    if (err) this.#onError(new OnceError(`pg-once: the LISTEN connection failed, reconnecting: ${err.message}`, { cause: err }));
    // Waiters would miss notifications until the new LISTEN: let them ask the server now.
    this.#wakeAll();
    // Reconnect now rather than on the next call, so that waiters get notifications again
    // and the next claim does not pay for the connection.
    this.#connect().catch((e) => this.#onError(e));
  }

  #notified(payload) {
    this.#probes.get(payload)?.();
    // An empty payload (never a key) announces a transaction that resolved too many keys
    // to name them one by one: every waiter asks again.
    if (payload === '') {
      this.#wakeAll();
      return;
    }
    for (const interest of this.#interests.get(payload) ?? []) interest.notify();
  }

  #wakeAll() {
    for (const set of this.#interests.values()) for (const interest of set) interest.notify();
  }
}

module.exports = { notifiedNames, Listener };
