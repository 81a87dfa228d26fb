// Compiled (never run) by `npm run typecheck`: the declarations in index.d.ts describe the API.
import pg from 'pg';
import { OnceClient, OnceFailed, type Job } from 'pg-once';

const client = new OnceClient({ pool: new pg.Pool(), listenConnectionString: 'postgres://direct/db', lease: 10 });
const n: number = await client.getOrCompute('k', async () => 42, { ttl: 60 });
const square = client.cached(async (x: number) => x * x, { key: (x) => `sq:${x}`, ttl: 3600 });
const s: number = await square(3);
const fresh: string = await client.getOrCompute('page', async () => 'html', { ttl: 15, stale: 300, beta: 1, jitter: 0.1 });
const worker = client.work<{ w: number }>('thumbnails', async (job: Job<{ w: number }>) => ({ width: job.payload.w }), { concurrency: 4 });
const stats = await worker.stop();
const other = await OnceClient.connect('postgres://pgbouncer/db', { listenConnectionString: 'postgres://direct/db', poolSize: 4 });
try {
  await other.getOrCompute('k', () => 'x');
} catch (err) {
  if (err instanceof OnceFailed) console.log(err.error, err.retryAt.toISOString());
}
console.log(n, s, fresh, stats.completed, client.ownerPid);
await client.end({ refreshTimeout: 5 });
