// pg-once: the node-postgres client of the pg_once PostgreSQL extension.
export { OnceClient } from './client.js';
export { Worker } from './worker.js';
export { OnceError, OnceFailed, OnceTimeout } from './errors.js';
