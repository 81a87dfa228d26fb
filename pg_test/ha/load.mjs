// The Node client's load in the HA test (pg_test/ha/README.md): compute-once calls on the
// keys the Python and Rust loads ask for at the same moment, and a queue worker, until the
// stop file appears. Every call is one JSON line in --out.
//
// Connecting: the client is given the multi-host URL users would write
// (postgres://h1:p1,h2:p2/db?target_session_attrs=read-write) and finds the primary
// itself, after a failover too (docs/clients.md, N7).
import { existsSync, openSync, writeSync } from 'node:fs';
import { randomUUID } from 'node:crypto';
import { parseArgs } from 'node:util';
import { OnceClient } from '../../clients/node/src/index.mjs';


const WAIT = 10; // each call's wait (seconds); a later answer (plus slack) is reported
const SLACK = 2;
const { values: args } = parseArgs({
  options: {
    url: { type: 'string' }, mode: { type: 'string' },
    stop: { type: 'string' }, out: { type: 'string' },
  },
});
const out = openSync(args.out, 'w');
const record = (rec) => writeSync(out, JSON.stringify({ ...rec, t: Date.now() / 1000 }) + '\n');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const within = (p, ms) => Promise.race([p, sleep(ms)]);

const opts = { poolSize: 4, connectTimeout: 3, onError: () => {} };
let client = null;
let worker = null;

async function handler(job) {
  record({ op: 'job', key: job.key, token: job.token });
  return { by: 'node', token: job.token };
}

function startWorker() {
  worker = client.work(`ha_${args.mode}`, handler,
    { concurrency: 2, lease: 10, idleWait: 1, handleSignals: false, stopTimeout: 2 });
  worker.done.catch((err) => record({ op: 'worker-stopped', error: String(err).slice(0, 200) }));
}

client = await OnceClient.connect(args.url, opts);
startWorker();
record({ op: 'start', multihost: true });
let stopping = false;
let pending = 0;
const mine = new Set();
const reported = new Set();

async function getter() {
  while (!stopping) {
    const key = `ha:${args.mode}:s:${Math.floor(Date.now() / 500)}`;
    const started = Date.now();
    pending += 1;
    try {
      const v = await client.getOrCompute(key, async () => {
        await sleep(100);
        const value = { by: 'node', pid: process.pid, u: randomUUID().replaceAll('-', '') };
        mine.add(value.u);
        return value;
      }, { lease: 10, wait: WAIT });
      const computed = mine.has(v.u) && !reported.has(v.u);
      reported.add(v.u);
      const ms = Date.now() - started;
      record({ op: 'get', key, ok: true, value: v, computed, ms, slow: ms > (WAIT + SLACK) * 1000 });
    } catch (err) {
      record({ op: 'get', key, ok: false, error: `${err?.name}: ${err?.message}`.slice(0, 200),
        slow: Date.now() - started > (WAIT + SLACK) * 1000 });
      await sleep(100);
    } finally {
      pending -= 1;
    }
    await sleep(50);
  }
}

const getters = [getter(), getter()];
while (!existsSync(args.stop)) await sleep(100);
stopping = true;
await within(Promise.all(getters), (WAIT + SLACK) * 1000);
record({ op: 'end', pending, multihost: true });
await within(client.end({ refreshTimeout: 1 }).catch(() => {}), 5000);
process.exit(0);
