// pg-once for ESM's import: the same objects as require('pg-once') (index.cjs), so that
// an application mixing both sees one OnceClient class and one set of error classes.
import cjs from './index.cjs';

export const {
  OnceClient,
  Worker,
  defaultKey,
  MAX_KEY_BYTES,
  OnceError,
  OnceFailed,
  OnceTimeout,
  ClaimLost,
  NotSerializable,
  ResultRefused,
  ConfigurationError,
} = cjs;
