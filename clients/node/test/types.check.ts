// Compiled (never run) by `npm run typecheck`: the declarations in index.d.cts (through
// index.d.mts, as import sees them) describe the API.
import pg from 'pg';
import {
  OnceClient, OnceFailed, ClaimLost, defaultKey, idempotency, idempotencyErrors, idempotencyPlugin, type IdempotencyClaim, type Job, type OutcomeEvent,
} from 'pg-once';

const client = new OnceClient({ pool: new pg.Pool(), listenConnectionString: 'postgres://direct/db', lease: 10 });
const n: number = await client.getOrCompute('k', async () => 42, { ttl: 60 });
const square = client.cached(async (x: number) => x * x, { key: (x) => `sq:${x}`, ttl: 3600 });
const s: number = await square(3);
const report = client.cached(async (n: number, region: string) => ({ n, region }), { name: 'report' });
const invalidated: boolean = await report.invalidate(7, 'eu');
const refreshed: string = await report.refresh(7, 'eu');
const key: string = defaultKey('report', [7, 'eu']);
const cancel = new AbortController();
const cancellable: number = await client.getOrCompute('c', async ({ signal }) => (signal.aborted ? 0 : 1), {
  signal: cancel.signal,
  onOutcome: (e: OutcomeEvent) => console.log(e.kind, e.duration),
  serialize: JSON.stringify,
  deserialize: JSON.parse,
});
const queued: string = await client.enqueue('job', { payload: { w: 1 }, queue: 'thumbnails' });
const batch: Map<string, string> = await client.enqueueMany(['a', { key: 'b', payload: { w: 2 } }], { queue: 'thumbnails' });
console.log(invalidated, refreshed, key, cancellable, queued, batch, new ClaimLost('k').kind);
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
const guard = idempotency({ client, secret: process.env.IDEMPOTENCY_SECRET ?? null, inFlight: 'wait', wait: 5, maxBody: 1 << 20, ttl: 3600, scope: (req) => String(req.user ?? '') || null });
const errors = idempotencyErrors();
console.log(typeof guard, typeof errors, typeof idempotencyPlugin);
await guard.close();
const answer = await client.claim('k', { fingerprint: new Uint8Array(32), wait: 1 });
if (answer.outcome === 'claimed') {
  await answer.claim.completeOn(new pg.Client(), { status: 201 }, { ttl: 60 });
  const released: boolean = await answer.claim.release();
  console.log(released);
} else if (answer.outcome === 'failed') {
  console.log(answer.error, answer.retryAt);
}
const onRequest = async (claim: IdempotencyClaim | undefined, db: pg.PoolClient) => {
  await claim?.complete(db, 201, { 'content-type': 'application/json' }, '{"id": 1}');
};
void onRequest;
await client.end({ refreshTimeout: 5 });
