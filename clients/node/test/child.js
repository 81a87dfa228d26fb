// A separate process for the tests (see helpers.js, child()): another "pod" with its own
// pool and listener. Prints JSON lines on stdout.
import { OnceClient } from '../src/index.mjs';
import pg from 'pg';

const [mode, argsJson] = process.argv.slice(2);
// Not a test file: `node --test` with no arguments finds it too. Run alone, do nothing.
if (!mode) process.exit(0);
const args = JSON.parse(argsJson);
const say = (msg) => process.stdout.write(`${JSON.stringify(msg)}\n`);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const pool = new pg.Pool({ connectionString: process.env.CHILD_POOL_DSN, max: args.poolSize ?? 4 });
pool.on('error', () => {});
const client = new OnceClient({ pool, listenConnectionString: process.env.CHILD_LISTEN_DSN, onError: () => {}, ...args.options });
await client.ready();
say({ ready: true, pid: process.pid, ownerPid: client.ownerPid });

if (mode === 'callers') {
  // args.callers concurrent callers, each asking for every key (rotated order).
  const computed = {};
  const answers = await Promise.all(Array.from({ length: args.callers }, async (_, n) => {
    const mine = [];
    for (let i = 0; i < args.keys.length; i += 1) {
      const key = args.keys[(n + i) % args.keys.length];
      mine.push(await client.getOrCompute(key, async () => {
        computed[key] = (computed[key] ?? 0) + 1;
        await sleep(args.computeMs);
        return { key, by: process.pid };
      }));
    }
    return mine;
  }));
  say({ computed, answers: answers.flat() });
} else if (mode === 'stale') {
  // args.callers concurrent callers ask for args.key at wall-clock time args.startAt, with a
  // stale window; each reports what it got and how long that took. end() then lets a
  // background refresh store its result.
  let computed = 0;
  await sleep(Math.max(0, args.startAt - Date.now()));
  const answers = await Promise.all(Array.from({ length: args.callers }, async () => {
    const started = Date.now();
    const value = await client.getOrCompute(args.key, async () => {
      computed += 1;
      await sleep(args.computeMs);
      return { by: process.pid };
    }, { ttl: 60, stale: 60 });
    return { value, ms: Date.now() - started };
  }));
  await client.end({ refreshTimeout: 30 });
  say({ computed, answers });
} else if (mode === 'hang') {
  // Claim args.key and never finish: the parent kills us mid-compute.
  await client.getOrCompute(args.key, () => {
    say({ computing: args.key });
    return new Promise(() => {});
  }, args.callOptions);
} else if (mode === 'worker') {
  const worker = client.work(args.queue, async (job) => {
    say({ started: job.key });
    await sleep(args.jobMs);
    say({ finished: job.key });
    return { done: job.key };
  }, { concurrency: args.concurrency ?? 1, idleWait: 0.2 });
  say({ working: true });
  const stats = await worker.done;
  say({ stopped: stats });
}
await client.end();
await pool.end();
