// pg-once: the node-postgres client of the pg_once PostgreSQL extension.
export { OnceClient } from './client.js';
export { Worker } from './worker.js';
export { defaultKey, MAX_KEY_BYTES } from './keys.js';
export {
  OnceError, OnceFailed, OnceTimeout, ClaimLost, NotSerializable, ResultRefused, ConfigurationError,
} from './errors.js';
