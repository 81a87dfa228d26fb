// The language-neutral conformance suite (clients/conformance/README.md), run by node --test:
// the offline vectors always, the scenarios against PG_ONCE_DSN. PG_ONCE_CONFORMANCE_DIR
// points at another copy of the suite (default: the repository's clients/conformance).
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { randomUUID } from 'node:crypto';
import { isDeepStrictEqual } from 'node:util';
import pg from 'pg';
import { defaultKey, OnceClient } from '../src/index.mjs';
import { serializer, toText } from '../src/values.cjs';
import { isConnectionError } from '../src/util.cjs';
import { DSN, setups, standbyFirstSetups, makeClient, closeClient, sleep } from './helpers.js';
import { startProxy, throughProxy } from './proxy.js';

const DIR = process.env.PG_ONCE_CONFORMANCE_DIR
  ?? fileURLToPath(new URL('../../conformance', import.meta.url));
const load = (sub) => {
  const dir = path.join(DIR, sub);
  if (!existsSync(dir)) return [];
  return readdirSync(dir).filter((f) => f.endsWith('.json')).sort()
    .map((f) => ({ file: `${sub}/${f}`, ...JSON.parse(readFileSync(path.join(dir, f), 'utf8')) }));
};

/** A case Node cannot run: a type JavaScript lacks, or another language's case. */
class NotApplicable extends Error {}

class Unsupported { constructor(what) { this.what = what; } }

/** A value in the vector notation (README, "Values in vectors") as JavaScript. */
function fromVector(v) {
  if (Array.isArray(v)) return v.map(fromVector);
  if (v === null || typeof v !== 'object') return v;
  const [tag, ...more] = Object.keys(v);
  if (more.length === 0 && tag?.startsWith('$')) {
    const x = v[tag];
    switch (tag) {
      case '$int': return BigInt(x);
      case '$float': return Number(x);
      case '$bytes': return Buffer.from(x, 'base64');
      case '$set': return new Set(x.map(fromVector));
      case '$map': return new Map(x.map(([k, val]) => [fromVector(k), fromVector(val)]));
      case '$datetime': return new Date(x);
      case '$unsupported': return new Unsupported(x);
      case '$repeat': return String(x[0]).repeat(x[1]);
      default: throw new NotApplicable(`${tag} has no JavaScript type`);
    }
  }
  return Object.fromEntries(Object.entries(v).map(([k, val]) => [k, fromVector(val)]));
}

/** Runs `body` for each case of `file`, skipping (and saying why) those Node cannot run. */
function cases(file, body) {
  describe(`${file.file} (rule ${file.rule})`, () => {
    for (const c of file.cases) {
      let skip = false;
      if (c.languages && !c.languages.includes('node')) skip = `only ${c.languages.join(', ')}`;
      if (c.python_params || c.kwargs) skip = 'Python only (keyword arguments)';
      test(c.name, { skip }, async (t) => {
        try {
          await body(c, t);
        } catch (err) {
          if (!(err instanceof NotApplicable)) throw err;
          t.skip(err.message);
        }
      });
    }
  });
}

const vectors = Object.fromEntries(load('vectors').map((f) => [path.basename(f.file, '.json'), f]));
if (!vectors.keys) {
  test('conformance vectors', { skip: `none in ${DIR} (set PG_ONCE_CONFORMANCE_DIR)` }, () => {});
}

if (vectors.keys) {
  cases(vectors.keys, (c) => {
    const args = fromVector(c.args);
    if (c.error) assert.throws(() => defaultKey(c.function, args), globalThis[c.error]);
    else assert.equal(defaultKey(c.function, args), c.key);
  });
}

if (vectors.values) {
  cases(vectors.values, (c) => {
    const value = fromVector(c.value);
    const json = serializer();
    if (c.error) {
      assert.throws(() => toText('k', value, json), (err) => err.kind === c.error);
      return;
    }
    const text = toText('k', value, json);
    assert.deepEqual(JSON.parse(text), c.stored);
    assert.deepEqual(json.deserialize(text), fromVector(c.returns));
  });
}

if (vectors.options) {
  // A pool that answers nothing: a call that passed every check reaches it and stops there.
  const reached = new Error('reached the pool');
  const client = new OnceClient({ pool: { query: () => Promise.reject(reached), options: {} }, listen: false });
  const camel = (name) => name.replace(/_([a-z])/g, (_, ch) => ch.toUpperCase());
  cases(vectors.options, async (c) => {
    const options = Object.fromEntries(Object.entries(c.options).map(([k, v]) => [camel(k), fromVector(v)]));
    const call = client.getOrCompute(c.key, () => 1, options);
    if (c.error) await assert.rejects(call, (err) => err instanceof TypeError || err instanceof RangeError);
    else await assert.rejects(call, (err) => err === reached);
  });
}

if (vectors.retry) {
  cases(vectors.retry, (c) => {
    const message = c.connection_lost ? 'Connection terminated unexpectedly' : 'something else';
    const err = Object.assign(new Error(message), c.sqlstate ? { code: c.sqlstate } : {});
    assert.equal(isConnectionError(err), c.retry);
  });
}

// ---- scenarios -------------------------------------------------------------------------

const scenarios = load('scenarios');
if (scenarios.length && !DSN) {
  test('conformance scenarios', { skip: 'PG_ONCE_DSN is not set' }, () => {});
}

for (const setup of scenarios.length ? [...setups, ...standbyFirstSetups] : []) {
  describe(`conformance scenarios (${setup.name})`, () => {
    let admin;
    before(async () => {
      admin = new pg.Client({ connectionString: DSN });
      await admin.connect();
    });
    after(() => admin.end());
    for (const file of scenarios) {
      // A file that names its setups runs only there; the others everywhere but there.
      if (!(file.setups ?? ['direct', 'pgbouncer', 'tls']).includes(setup.kind ?? setup.name)) continue;
      cases(file, (c) => runScenario(setup, admin, c));
    }
  });
}

// The scenarios' option names (docs/clients.md's) as this client spells them.
const OPTION_NAMES = { listen_conninfo: 'listenConnectionString' };

/** A query's rows as arrays of its columns' values, as a scenario writes them. */
const rowsOf = (result) => result.rows.map((r) => result.fields.map((f) => r[f.name]));

async function runScenario(setup, admin, scenario) {
  // `proxy`: each client's pool through a proxy of ours to PG_ONCE_DSN's server (README).
  let proxied = null;
  if (scenario.proxy) {
    if ((setup.kind ?? setup.name) !== 'direct') {
      throw new NotApplicable(`a case with "proxy" runs in the direct setup only (its proxies forward to the server itself, not through ${setup.name})`);
    }
    proxied = throughProxy(setup.poolDsn);
    if (!proxied) throw new NotApplicable(`"proxy" needs PG_ONCE_DSN as a postgresql:// URL of one TCP host, not ${setup.poolDsn}`);
  }
  const run = randomUUID();
  const prefix = `conf/${run}/`;
  const keyed = (k) => `${prefix}${k}`;
  // A queue of the run's own (README, {queue:q}): a queue name allows no '/'.
  const queueOf = (q) => `${q}_${run.slice(0, 8)}`;
  const sqlText = (s) => s.replace(/\{queue:(\w+)\}/g, (_, q) => queueOf(q))
    .replace(/\{key:((?:[^}"]|"[^"]*")*)\}/g, (_, k) => keyed(k).replace(/'/g, "''"));
  const counters = new Map();
  const count = (name) => counters.set(name, (counters.get(name) ?? 0) + 1);
  const running = new Map();
  // Each background call's AbortController, for a `cancel` step.
  const cancellers = new Map();
  // The workers of `work` steps, by their `as`, for `stop` steps.
  const workers = new Map();
  // The pid of each client's LISTEN connection a `kill_listener` step terminated.
  const killed = new Map();
  // `listen: "pool"`: the LISTEN connection goes where the pool does (README).
  const listenDsn = scenario.listen === 'pool' ? setup.poolDsn : setup.listenDsn;
  // Each client's outcome hook events (docs/clients.md, O1), in order.
  const outcomes = Array.from({ length: scenario.clients ?? 1 }, () => []);
  // One proxy per client, started before the clients that connect through them.
  const proxies = proxied ? await Promise.all(outcomes.map(() => startProxy(proxied.target))) : [];
  const clients = outcomes.map((seen, n) => makeClient(
    { ...setup, poolDsn: proxied ? proxied.dsnFor(proxies[n]) : setup.poolDsn, listenDsn },
    { onOutcome: (e) => seen.push(e) },
  ));
  const computeOf = (spec = {}) => async ({ signal } = {}) => {
    if (spec.counts) count(spec.counts);
    // `counts_stop`: counted when the call's cancellation stops the computation.
    if (spec.counts_stop) signal?.addEventListener('abort', () => count(spec.counts_stop));
    if (spec.sleep_ms) {
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, spec.sleep_ms);
        signal?.addEventListener('abort', () => { clearTimeout(timer); resolve(); });
      });
    }
    if (spec.raises !== undefined) throw new Error(spec.raises);
    return fromVector(spec.returns ?? null);
  };
  const camel = (name) => name.replace(/_([a-z])/g, (_, ch) => ch.toUpperCase());
  const optionsOf = (o = {}) => Object.fromEntries(Object.entries(o).map(([k, v]) => [camel(k), fromVector(v)]));
  const call = (step) => {
    const client = clients[step.client ?? 0];
    const wrapper = () => client.cached(computeOf(step.compute), { name: keyed(step.name), ...optionsOf(step.options) });
    switch (step.call) {
      case 'ready': return client.ready().then(() => true);
      case 'get_or_compute': {
        const options = optionsOf(step.options);
        if (step.background) {
          const controller = new AbortController();
          cancellers.set(step.as, controller);
          options.signal = controller.signal;
        }
        return client.getOrCompute(keyed(step.key), computeOf(step.compute), options);
      }
      case 'cached': return wrapper()(...fromVector(step.args));
      case 'invalidate': return step.name ? wrapper().invalidate(...fromVector(step.args)) : client.invalidate(keyed(step.key));
      case 'refresh': return step.name ? wrapper().refresh(...fromVector(step.args)) : client.refresh(keyed(step.key), optionsOf(step.options));
      case 'enqueue': return client.enqueue(keyed(step.key), optionsOf(step.options));
      case 'work': {
        // The handler sleeps the job's payload's sleep_ms, then returns the payload or
        // raises its `raises`; the worker stops once it has run max_jobs handlers, or at a
        // `stop` step naming it. W2's `grace` is this client's stopTimeout.
        let handled = 0;
        let worker;
        const handler = async ({ payload, signal }) => {
          if (step.handler?.counts) count(step.handler.counts);
          handled += 1;
          if (handled >= (step.max_jobs ?? Infinity)) worker.stop();
          const object = payload && typeof payload === 'object' ? payload : {};
          if (object.sleep_ms) {
            await new Promise((resolve, reject) => {
              const timer = setTimeout(resolve, object.sleep_ms);
              signal.addEventListener('abort', () => {
                clearTimeout(timer);
                // `counts_stop`: the worker's stop cancelled the handler (W3).
                if (step.handler?.counts_stop) count(step.handler.counts_stop);
                reject(signal.reason);
              }, { once: true });
            });
          }
          if ('raises' in object) throw new Error(object.raises);
          return payload ?? null;
        };
        const { grace, ...options } = step.options ?? {};
        worker = client.work(queueOf(step.queue), handler, {
          handleSignals: false, idleWait: 0.2, ...options, ...(grace === undefined ? {} : { stopTimeout: grace }),
        });
        if (step.as) workers.set(step.as, worker);
        return worker.done.then(() => handled);
      }
      case 'enqueue_many': return client.enqueueMany(
        step.jobs.map((j) => ({ key: keyed(j.key), payload: fromVector(j.payload ?? null) })), optionsOf(step.options),
      ).then((answered) => [...answered.values()]);
      default: throw new NotApplicable(`call ${step.call} is not run by the Node runner yet`);
    }
  };
  const check = async (promise, expect = {}, started, within, step = {}) => {
    let value;
    let error;
    // A call bounded by within_ms is not awaited much past it: one that never settles (its
    // answer held by a paused proxy, say) fails the case instead of hanging the run.
    const late = Symbol('still running');
    let timer;
    const bound = within === undefined ? promise : Promise.race([promise, new Promise((resolve) => {
      timer = setTimeout(() => resolve(late), Math.max(0, started + within + 100 - Date.now()));
    })]);
    try {
      value = await bound;
    } catch (err) {
      error = err;
    } finally {
      clearTimeout(timer);
    }
    assert.ok(value !== late, `still running ${Date.now() - started} ms after it started, more than ${within}`);
    if (within !== undefined) assert.ok(Date.now() - started <= within, `took ${Date.now() - started} ms, more than ${within}`);
    if (expect.outcome) {
      // The last event of that client for that key.
      const key = keyed(step.key ?? '');
      const last = outcomes[step.client ?? 0].filter((e) => e.key === key).at(-1);
      assert.equal(last?.kind, expect.outcome, 'the outcome hook');
    }
    if (expect.error) {
      assert.ok(error, `expected ${expect.error}, got the value ${JSON.stringify(value)}`);
      assert.equal(error.kind, expect.error, error.stack);
      // This client's name of the option.
      if (expect.message_names_option) assert.match(error.message, new RegExp(OPTION_NAMES[expect.message_names_option]));
      if (expect.message_contains) assert.ok(`${error.message} ${error.error ?? ''}`.includes(expect.message_contains), error.message);
      if (expect.sqlstate) assert.equal(error.code, expect.sqlstate);
    } else if (expect.raised !== undefined) {
      assert.equal(error?.message, expect.raised);
    } else {
      if (error) throw error;
      if ('value' in expect) assert.deepEqual(value, fromVector(expect.value));
    }
  };
  try {
    // Connected first, as a running process's client is: a step's within_ms times the call.
    // Not one whose LISTEN connection goes through the pool: its steps see it refused.
    if (scenario.listen !== 'pool') await Promise.all(clients.map((c) => c.ready()));
    for (const sql of scenario.setup ?? []) await admin.query(sqlText(sql));
    for (const step of scenario.steps) {
      if (step.sql !== undefined) {
        let result = await admin.query(sqlText(step.sql));
        if (Array.isArray(result)) result = result[result.length - 1];
        if (step.expect?.rows) assert.deepEqual(rowsOf(result), step.expect.rows);
      } else if (step.call) {
        const started = Date.now();
        const promise = call(step);
        if (step.background) {
          promise.catch(() => {});
          running.set(step.as, { promise, started, call: step });
        } else {
          await check(promise, step.expect, started, step.within_ms, step);
        }
      } else if (step.until?.counter) {
        // Waited for, up to 10 s: a counter reaching a count.
        const [name, n] = step.until.counter;
        const deadline = Date.now() + 10_000;
        while ((counters.get(name) ?? 0) < n && Date.now() < deadline) await sleep(5);
        assert.ok((counters.get(name) ?? 0) >= n, `counter ${name} never reached ${n}`);
      } else if (step.until?.sql !== undefined) {
        // Waited for, up to 10 s: the SQL's rows becoming those (a claim reached the server).
        const text = sqlText(step.until.sql);
        const deadline = Date.now() + 10_000;
        let rows = rowsOf(await admin.query(text));
        while (!isDeepStrictEqual(rows, step.until.rows) && Date.now() < deadline) {
          await sleep(20);
          rows = rowsOf(await admin.query(text));
        }
        assert.deepEqual(rows, step.until.rows, `${text} never answered these rows within 10 s`);
      } else if (step.pause !== undefined) {
        assert.ok(proxies[step.pause], `pause: client ${step.pause} has no proxy (the case needs "proxy": true)`);
        proxies[step.pause].pause();
      } else if (step.resume !== undefined) {
        assert.ok(proxies[step.resume], `resume: client ${step.resume} has no proxy (the case needs "proxy": true)`);
        proxies[step.resume].resume();
      } else if (step.kill_listener !== undefined) {
        await clients[step.kill_listener].ready();
        const pid = clients[step.kill_listener].ownerPid;
        assert.ok(pid > 0, 'the client listens');
        killed.set(step.kill_listener, pid);
        // Waited for until the backend has exited (up to 10 s): a claim made with its pid
        // while it is still exiting would be accepted, then lost with it, where the
        // scenario means a claim refused for a dead pid (R3).
        await admin.query('SELECT pg_terminate_backend($1, 10000)', [pid]);
      } else if (step.expect?.new_listener !== undefined) {
        // The client listens again, on another backend: waited for, up to 10 s.
        const n = step.expect.new_listener;
        const deadline = Date.now() + 10_000;
        const moved = () => clients[n].ownerPid > 0 && clients[n].ownerPid !== killed.get(n);
        while (!moved() && Date.now() < deadline) await sleep(20);
        assert.ok(moved(), `client ${n} listens as ${clients[n].ownerPid}, killed ${killed.get(n)}`);
      } else if (step.stop) {
        workers.get(step.stop).stop(); // gracefully: its grace, then the handlers' signals abort (W3)
      } else if (step.cancel) {
        // The call rejects with the abort's reason: the error kind Cancelled.
        cancellers.get(step.cancel).abort(Object.assign(new Error('cancelled by the scenario'), { kind: 'Cancelled' }));
      } else if (step.await) {
        const { promise, started, call } = running.get(step.await);
        await check(promise, step.expect, started, step.within_ms, call);
      } else if (step.sleep_ms !== undefined) {
        await sleep(step.sleep_ms);
      } else if (step.expect?.outcomes) {
        const [number, kinds] = step.expect.outcomes;
        assert.deepEqual(outcomes[number].map((e) => e.kind).sort(), [...kinds].sort(), `client ${number}'s outcomes`);
        // `at_least_ms`: every call of that kind took at least that long.
        for (const [kind, ms] of Object.entries(step.expect.at_least_ms ?? {})) {
          for (const e of outcomes[number].filter((o) => o.kind === kind)) {
            assert.ok(e.duration >= ms, `a ${kind} call took ${e.duration} ms`);
          }
        }
      } else if (step.expect?.counter) {
        const [name, n] = step.expect.counter;
        assert.equal(counters.get(name) ?? 0, n, `counter ${name}`);
      } else {
        throw new NotApplicable(`a step the Node runner does not know: ${JSON.stringify(step)}`);
      }
    }
  } finally {
    // Nothing held any more: a call, or a client's end, waiting for an answer a failed case
    // left in a paused proxy gets it.
    for (const proxy of proxies) proxy.resume();
    await Promise.allSettled([...running.values()].map((r) => r.promise));
    await Promise.all(clients.map(closeClient));
    await Promise.all(proxies.map((proxy) => proxy.close()));
  }
}
