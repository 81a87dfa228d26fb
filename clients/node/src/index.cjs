// pg-once: the node-postgres client of the pg_once PostgreSQL extension. Written as
// CommonJS so that require() works on every Node version package.json's engines names;
// index.mjs gives ESM's import the same objects.
'use strict';

const { OnceClient } = require('./client.cjs');
const { Worker } = require('./worker.cjs');
const { defaultKey, MAX_KEY_BYTES } = require('./keys.cjs');
const { Claim } = require('./claim.cjs');
const { idempotency, idempotencyErrors } = require('./express.cjs');
const { idempotencyPlugin } = require('./fastify.cjs');
const {
  OnceError, OnceFailed, OnceTimeout, ClaimLost, NotSerializable, ResultRefused, ConfigurationError,
} = require('./errors.cjs');

module.exports = {
  OnceClient,
  Worker,
  Claim,
  idempotency,
  idempotencyErrors,
  idempotencyPlugin,
  defaultKey,
  MAX_KEY_BYTES,
  OnceError,
  OnceFailed,
  OnceTimeout,
  ClaimLost,
  NotSerializable,
  ResultRefused,
  ConfigurationError,
};
