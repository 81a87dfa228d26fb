// The idempotency middleware for Express (and plain Node http handlers of the same
// shape): docs/clients.md, rule I. Nothing here requires express: a middleware is a
// function of (req, res, next), and the request and response are Node's own.
//
//   app.use(idempotency({ client }));             // before express.json() and the routes
//   app.post('/orders', express.json(), handler);
//   app.use(idempotencyErrors());                 // after the routes: problem+json, ClaimLost
'use strict';

const { ClaimLost } = require('./errors.cjs');
const { Gate } = require('./http.cjs');
const { headerPairs, problem } = require('./idempotency.cjs');

const STATE = Symbol('pg-once idempotency');

/**
 * An Express middleware running each POST/PATCH request that carries an Idempotency-Key
 * at most once per key (rule I). `options`: `client` (an OnceClient) or
 * `connectionString`, and the rule's options (camelCase). The returned function has
 * `close()`, which ends the client it made from a connection string.
 */
function idempotency(options) {
  const gate = new Gate(options);
  const middleware = (req, res, next) => {
    handle(gate, req, res, next).catch(next);
  };
  middleware.close = () => gate.close();
  return middleware;
}

/**
 * The error handler that goes after the routes: a handler that threw under a claim gets
 * its claim given back and a 500 problem+json (I5, I7); one that threw ClaimLost (its
 * completion refused, I8) is answered as a concurrent duplicate. Errors that carry a
 * status below 500 (http-errors') and requests without a claim go on to the next handler.
 */
function idempotencyErrors() {
  return (err, req, res, next) => {
    const rc = req[STATE];
    if (!rc || res.headersSent || (err instanceof Error && !(err instanceof ClaimLost) && (err.status ?? err.statusCode) < 500)) {
      next(err);
      return;
    }
    const answered = err instanceof ClaimLost
      ? rc.lost()
      : rc.abandon().then(() => problem('handler_failed', 'The request failed; it was not stored, and a retry with the same key runs it again.'));
    answered.then((answer) => send(res, answer), next);
  };
}

async function handle(gate, req, res, next) {
  const checked = gate.check(req.method, req.headers);
  if (checked.pass) return next();
  if (checked.answer) return send(res, checked.answer);
  if (req.readableEnded || req._body) {
    throw new TypeError('pg-once: idempotency() must come before the body parsers (express.json() ...): it reads the raw body for the fingerprint and hands it on');
  }
  const body = await readBodyKeepingIt(req, gate.options.maxRequestBody);
  if (body === null) return send(res, gate.tooLarge(), { close: true });
  const decision = await gate.begin({
    key: checked.key, method: req.method, url: req.originalUrl ?? req.url, headers: req.headers, body, request: req,
  });
  if (decision.answer) return send(res, decision.answer);
  req[STATE] = decision.claim;
  req.idempotency = decision.claim;
  collectResponse(res, decision.claim, gate.options.maxBody);
  return next();
}

/**
 * The request body, read whole, and left in the request for whoever reads it next
 * (express.json(), the handler): read() until the request is complete, then unshift()
 * the bytes back before 'end' is emitted, which Node does only once the buffer is empty.
 * null when it is longer than `limit` (the stream is left as it is: the answer is 413).
 */
function readBodyKeepingIt(req, limit) {
  const declared = Number(req.headers['content-length']);
  if (declared > limit) return Promise.resolve(null);
  if (declared === 0 && req.headers['transfer-encoding'] === undefined) return Promise.resolve(Buffer.alloc(0));
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    const done = (result) => {
      req.removeListener('readable', onReadable);
      req.removeListener('error', onError);
      resolve(result);
    };
    const onError = (err) => {
      req.removeListener('readable', onReadable);
      reject(err);
    };
    function onReadable() {
      while (req.readableLength > 0) {
        const chunk = req.read();
        if (chunk === null) break;
        chunks.push(chunk);
        size += chunk.length;
        if (size > limit) {
          done(null);
          return;
        }
      }
      if (req.complete && req.readableLength === 0) {
        const body = Buffer.concat(chunks, size);
        if (body.length > 0) req.unshift(body); // before 'end': it is emitted on a later tick
        done(body);
      }
    }
    req.on('error', onError);
    req.on('readable', onReadable);
  });
}

/**
 * Collect the response while it streams to the caller (I5), and store it before its last
 * bytes go out: a retry that arrives once the caller has the response is replayed, never
 * told 409. A response that breaks once its head went out keeps its claim, stored without
 * its body: the handler ran, and its side effects may have committed.
 */
function collectResponse(res, rc, maxBody) {
  const writeHead = res.writeHead;
  const write = res.write;
  const end = res.end;
  let head = null;
  let chunks = [];
  let size = 0;
  const current = () => res.getHeaderNames().flatMap((name) => {
    const value = res.getHeader(name);
    return Array.isArray(value) ? value.map((v) => [name, v]) : [[name, value]];
  });
  const collect = (chunk, encoding) => {
    if (chunk === null || chunk === undefined || typeof chunk === 'function' || chunks === null) return;
    const bytes = typeof chunk === 'string' ? Buffer.from(chunk, typeof encoding === 'string' ? encoding : 'utf8') : Buffer.from(chunk);
    size += bytes.length;
    if (size > maxBody) chunks = null; // stored without its body; the caller still gets all of it
    else chunks.push(bytes);
  };
  res.writeHead = function (status, ...rest) {
    if (!head) {
      const given = headerPairs(rest.find((r) => r !== null && typeof r === 'object'));
      const names = new Set(given.map(([n]) => n.toLowerCase()));
      head = { status, headers: [...current().filter(([n]) => !names.has(n)), ...given] };
    }
    return writeHead.call(this, status, ...rest);
  };
  res.write = function (chunk, encoding, ...rest) {
    collect(chunk, encoding);
    return write.call(this, chunk, encoding, ...rest);
  };
  res.end = function (chunk, encoding, callback) {
    collect(chunk, encoding);
    const { status, headers } = head ?? { status: res.statusCode, headers: current() };
    rc.finish(status, headers, chunks && Buffer.concat(chunks, size)).then((answer) => {
      if (answer && !res.headersSent) {
        for (const name of res.getHeaderNames()) res.removeHeader(name);
        res.writeHead = writeHead;
        res.write = write;
        res.end = end;
        send(res, answer);
      } else {
        end.call(res, chunk, encoding, callback);
      }
    }, (err) => res.destroy(err));
    return this;
  };
  // Closed once its head went out, before end(): the stream broke or the caller hung up.
  // Stored without its body (a no-op once finish() has begun). A response still being
  // computed keeps its claim, finished or not.
  res.on('close', () => {
    if (!res.headersSent) return;
    const { status, headers } = head ?? { status: res.statusCode, headers: current() };
    rc.finish(status, headers, null);
  });
}

/** Send an answer of the middleware's own (a replay, a problem). */
function send(res, { status, headers, body }, { close = false } = {}) {
  const grouped = new Map();
  for (const [name, value] of headers) grouped.set(name, [...(grouped.get(name) ?? []), value]);
  for (const [name, values] of grouped) res.setHeader(name, values.length === 1 ? values[0] : values);
  if (close) res.setHeader('connection', 'close');
  res.statusCode = status;
  res.end(body);
}

module.exports = { idempotency, idempotencyErrors };
