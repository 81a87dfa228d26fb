// The idempotency plugin for Fastify: docs/clients.md, rule I. Nothing here requires
// fastify: a plugin is a function of (instance, options) that adds hooks.
//
//   await app.register(idempotencyPlugin, { client });   // before the routes it covers
//
// It is not encapsulated (fastify-plugin's skip-override): its hooks apply to the routes
// of the scope it is registered in, and that scope's children. Register it inside a
// scope (app.register(async (scope) => { ... })) to cover only that scope's routes.
'use strict';

const { Readable, Transform, pipeline } = require('node:stream');
const { ClaimLost } = require('./errors.cjs');
const { Gate } = require('./http.cjs');
const { headerPairs, problem } = require('./idempotency.cjs');

const STATE = Symbol('pg-once idempotency');

/**
 * A Fastify plugin running each POST/PATCH request that carries an Idempotency-Key at most
 * once per key (rule I). Options: `client` (an OnceClient) or `connectionString`, and the
 * rule's options (camelCase). The request carries its claim as `request.idempotency`.
 */
async function idempotencyPlugin(fastify, options) {
  const { prefix, logLevel, logSerializers, ...own } = options ?? {}; // Fastify's own register options
  const gate = new Gate(own);
  if (!fastify.hasRequestDecorator('idempotency')) fastify.decorateRequest('idempotency', null);
  fastify.addHook('onClose', async () => gate.close());
  fastify.addHook('preParsing', (request, reply, payload) => claim(gate, request, reply, payload));
  fastify.addHook('onError', async (request, reply, error) => {
    if (request[STATE]) request[STATE].error = error;
  });
  fastify.addHook('onSend', (request, reply, payload) => collect(gate, request, reply, payload));
}
// fastify-plugin's marks, without depending on it: no scope of its own, and a name.
idempotencyPlugin[Symbol.for('skip-override')] = true;
idempotencyPlugin[Symbol.for('fastify.display-name')] = 'pg-once-idempotency';
idempotencyPlugin[Symbol.for('plugin-meta')] = { name: 'pg-once-idempotency', fastify: '>=4' };

/**
 * Before the body is parsed: read it (the fingerprint's bytes), claim, and either answer
 * (reply sent: Fastify goes no further) or hand the parser the same bytes.
 */
async function claim(gate, request, reply, payload) {
  const checked = gate.check(request.method, request.headers);
  if (checked.pass) return payload;
  if (checked.answer) return send(reply, checked.answer);
  const body = await readBody(payload, gate.options.maxRequestBody, request.headers);
  if (body === null) return send(reply.header('connection', 'close'), gate.tooLarge());
  const decision = await gate.begin({
    key: checked.key, method: request.method, url: request.raw.url, headers: request.headers, body, request,
  });
  if (decision.answer) return send(reply, decision.answer);
  request[STATE] = { claim: decision.claim, error: null, head: null };
  request.idempotency = decision.claim;
  // Closed once its head went out, before it was stored: the stream broke or the caller
  // hung up. The handler ran, so the claim is kept: stored without its body (a no-op once
  // finish() has begun). A reply the handler hijacked (no onSend: its head is unknown) is
  // given back. A response still being computed keeps its claim.
  reply.raw.on('close', () => {
    if (!reply.raw.headersSent) return;
    const { head } = request[STATE];
    if (head) decision.claim.finish(head.status, head.headers, null);
    else decision.claim.abandon();
  });
  const again = Readable.from([body], { objectMode: false });
  again.receivedEncodedLength = body.length; // what Fastify compares with content-length
  return again;
}

async function readBody(payload, limit, headers) {
  if (Number(headers['content-length']) > limit) return null;
  const chunks = [];
  let size = 0;
  for await (const chunk of payload) {
    size += chunk.length;
    if (size > limit) return null;
    chunks.push(chunk);
  }
  return Buffer.concat(chunks, size);
}

/** Before the response goes out: store it (I5), or answer in its place (I7, I8). */
async function collect(gate, request, reply, payload) {
  const state = request[STATE];
  if (!state || state.collected) return payload;
  state.collected = true;
  const rc = state.claim;
  const { error } = state;
  if (error instanceof ClaimLost) return replace(reply, await rc.lost());
  if (error && reply.statusCode >= 500) {
    await rc.abandon();
    return replace(reply, problem('handler_failed', 'The request failed; it was not stored, and a retry with the same key runs it again.'));
  }
  const status = reply.statusCode;
  const headers = headerPairs(reply.getHeaders());
  state.head = { status, headers };
  if (payload !== null && typeof payload === 'object' && typeof payload.pipe === 'function') {
    return collectStream(rc, status, headers, payload, gate.options.maxBody);
  }
  const bytes = payload === undefined || payload === null ? Buffer.alloc(0) : Buffer.from(payload);
  const answer = await rc.finish(status, headers, bytes.length > gate.options.maxBody ? null : bytes);
  return answer ? replace(reply, answer) : payload;
}

/**
 * A streamed response goes on to the caller chunk by chunk, collected meanwhile; its end
 * waits until it is stored. A stream that breaks is stored without its body: its head is
 * on its way, the handler ran (I5).
 */
function collectStream(rc, status, headers, stream, maxBody) {
  let chunks = [];
  let size = 0;
  const collector = new Transform({
    transform(chunk, encoding, callback) {
      const bytes = Buffer.from(chunk, typeof chunk === 'string' ? encoding : undefined);
      size += bytes.length;
      if (size > maxBody) chunks = null;
      else chunks?.push(bytes);
      callback(null, bytes);
    },
    flush(callback) {
      rc.finish(status, headers, chunks && Buffer.concat(chunks, size)).then(() => callback(), callback);
    },
  });
  pipeline(stream, collector, (err) => {
    if (err) rc.finish(status, headers, null);
  });
  return collector;
}

/** Answer `answer` instead of the response the handler made. */
function replace(reply, { status, headers, body }) {
  for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name);
  setHeaders(reply.code(status), headers);
  return body;
}

/** Send an answer of the plugin's own (a replay, a problem) from a hook. */
function send(reply, { status, headers, body }) {
  setHeaders(reply.code(status), headers);
  reply.send(body.length ? body : undefined);
  return reply;
}

/** Headers in order, a repeated name (set-cookie) as one array. */
function setHeaders(reply, headers) {
  const grouped = new Map();
  for (const [name, value] of headers) grouped.set(name, [...(grouped.get(name) ?? []), value]);
  for (const [name, values] of grouped) reply.header(name, values.length === 1 ? values[0] : values);
}

module.exports = { idempotencyPlugin };
