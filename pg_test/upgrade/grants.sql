-- The grants fill.sql gives its application role, as a fresh install of the current
-- version would be given them: the upgraded database must dump the same (upgrade-test.sh).
GRANT USAGE ON SCHEMA once TO up_app;
GRANT EXECUTE ON FUNCTION once.claim_key(text, interval, interval, integer, boolean),
                          once.complete_key(text, bigint, jsonb, interval, interval, float8, float8),
                          once.complete_keys(text[], bigint[], jsonb[], interval, interval, float8, float8),
                          once.fail_key(text, bigint, text, interval)
    TO up_app;
