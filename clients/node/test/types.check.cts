// The types as a CommonJS TypeScript program sees them (require('pg-once')): npm run typecheck.
import pg = require('pg');
import once = require('pg-once');

async function main(): Promise<void> {
  const client = new once.OnceClient({ pool: new pg.Pool() });
  const n: number = await client.getOrCompute('k', async ({ signal }) => (signal.aborted ? 0 : 1));
  const f = client.cached(async (a: number, b: string) => `${a}${b}`, { name: 'f', ttl: 60 });
  const s: string = await f(1, 'x');
  const gone: boolean = await f.invalidate(1, 'x');
  if (n + s.length > 0 && gone) await client.end();
  const err: unknown = new once.ClaimLost('k');
  if (err instanceof once.OnceError) console.log(err.message);
}
void main;
