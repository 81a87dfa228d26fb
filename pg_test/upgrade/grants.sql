-- The grants fill.sql gives its application role, as a fresh install of the current
-- version would be given them: the upgraded database must dump the same (upgrade-test.sh).
GRANT USAGE ON SCHEMA once TO up_app;
-- claim_key is dropped and created by the update (0.3.0 added fingerprint): its grant is
-- carried over to the new signature.
GRANT EXECUTE ON FUNCTION once.claim_key(text, interval, interval, integer, boolean, bytea),
                          once.get(text),
                          once.complete_key(text, bigint, jsonb, interval, interval, float8, float8),
                          once.complete_keys(text[], bigint[], jsonb[], interval, interval, float8, float8),
                          once.fail_key(text, bigint, text, interval),
                          once.enqueue_key(text, jsonb, text, integer, timestamptz, boolean, integer),
                          once.enqueue_keys(text[], jsonb[], text, integer, timestamptz, boolean, integer),
                          once.create_queue(text, integer, interval, interval, text)
    TO up_app;
GRANT SELECT ON once.stats TO up_app;
-- Set before the update in the upgraded database (fill.sql), where they must have given
-- nothing; here, after the install, so that both dumps list them.
ALTER DEFAULT PRIVILEGES GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO up_intruder;
ALTER DEFAULT PRIVILEGES GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO up_intruder;
ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON ROUTINES TO up_intruder;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO up_intruder;
