-- The hand-made protocol pg_once replaces (the seed's url_scans table), as a baseline.
-- Its trigger uses one channel and pg_notify (the seed built 'NOTIFY ' || url by string,
-- which is both injectable and one channel per key); that only makes the baseline faster.
SET client_min_messages = warning;
DROP TABLE IF EXISTS url_scans;
CREATE TABLE url_scans (
    url        text PRIMARY KEY,
    status     text NOT NULL,          -- in_progress | failed | completed
    result     jsonb,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE OR REPLACE FUNCTION url_scans_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> OLD.status THEN
        PERFORM pg_notify('url_scans', NEW.url);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER url_scans_notify AFTER UPDATE ON url_scans
    FOR EACH ROW EXECUTE FUNCTION url_scans_notify();
