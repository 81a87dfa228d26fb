// An Express service whose POST /orders runs at most once per Idempotency-Key, with
// pg-once's idempotency middleware. It is also the example service of the shared HTTP
// scenarios (clients/conformance/http/README.md): the same routes and handler as the
// Python and Rust ones.
//
//   PG_ONCE_DSN=postgres://... IDEMPOTENCY_SECRET=$(openssl rand -hex 32) node server.mjs 8000
import express from 'express';
import pg from 'pg';
import { OnceClient, idempotency, idempotencyErrors } from 'pg-once';

const dsn = process.env.PG_ONCE_DSN;
const port = Number(process.argv[2] ?? process.env.PORT ?? 8000);

// The handler's own connections, for its business transaction.
const db = new pg.Pool({ connectionString: dsn, max: 20 });
// pg_once's: a pool and the LISTEN connection that owns this process's claims.
const once = await OnceClient.connect(dsn);

// The secret keys the entries and authenticates the stored responses (docs/clients.md,
// I2): the same in every process of the service, kept like any other secret of it.
const options = { client: once, secret: process.env.IDEMPOTENCY_SECRET, ttl: 3600, maxBody: 1024 * 1024 };
const app = express();
app.get('/health', (req, res) => res.json({ ok: true }));
// The middleware goes before the body parser: it reads the raw body for the
// fingerprint, then hands the same bytes on to express.json().
app.post('/orders', idempotency(options), express.json(), createOrder);
app.post('/wait/orders', idempotency({ ...options, inFlight: 'wait', wait: 10 }), express.json(), createOrder);
app.post('/strict/orders', idempotency({ ...options, required: true }), express.json(), createOrder);
app.post('/bare/orders', express.json(), createOrder);
// After the routes: a handler that throws gets a problem+json 500 and its claim given
// back; a completion refused because the claim was taken over (ClaimLost) gets 409.
app.use(idempotencyErrors());

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function createOrder(req, res) {
  const key = req.get('idempotency-key') ?? null;
  const {
    sku = null, sleep_ms: sleepMs = 0, status = 201, raise = false, size = 0, chunks = 0,
  } = req.body ?? {};
  await db.query('INSERT INTO idem_demo.started (idempotency_key, pid) VALUES ($1, $2)', [key, process.pid]);
  await sleep(sleepMs);
  if (raise) throw new Error('asked to raise');
  if (status >= 500) {
    res.status(status).json({ error: 'asked' });
    return;
  }
  if (chunks > 0) {
    await db.query('INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES ($1, $2, $3)', [key, JSON.stringify(sku), process.pid]);
    res.writeHead(201, { 'content-type': 'text/plain' });
    for (let i = 0; i < chunks; i += 1) {
      res.write('x'.repeat(size));
      await sleep(10);
    }
    res.end();
    return;
  }
  // The order and the stored response commit together (rule I8): if this request's claim
  // was taken over meanwhile, complete() throws ClaimLost and the order rolls back.
  const conn = await db.connect();
  try {
    await conn.query('BEGIN');
    const { rows: [{ id }] } = await conn.query(
      'INSERT INTO idem_demo.orders (idempotency_key, sku, pid) VALUES ($1, $2, $3) RETURNING id',
      [key, JSON.stringify(sku), process.pid]);
    const body = JSON.stringify({ order_id: Number(id), sku, pid: process.pid, padding: 'x'.repeat(size) });
    const headers = {
      'content-type': 'application/json', location: `/orders/${id}`, 'set-cookie': 'visited=1', 'x-handler-pid': String(process.pid),
    };
    await req.idempotency?.complete(conn, status, headers, body);
    await conn.query('COMMIT');
    res.writeHead(status, headers).end(body);
  } catch (err) {
    await conn.query('ROLLBACK');
    throw err;
  } finally {
    conn.release();
  }
}

const server = app.listen(port, '127.0.0.1', () => console.log(`listening on http://127.0.0.1:${port}`));
// Stop taking requests, give those running a few seconds, then end: a request cut short
// here holds a claim that ends with this process's owner session, so a retry runs.
process.once('SIGTERM', () => {
  setTimeout(() => process.exit(0), 5000).unref();
  server.close(async () => {
    await once.end();
    await db.end();
    process.exit(0);
  });
  server.closeIdleConnections();
});
