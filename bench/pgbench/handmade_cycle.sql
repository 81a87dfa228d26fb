-- One compute cycle of the hand-made protocol on a fresh key: look, elect, complete.
\set k random(1, 4000000000000)
SELECT status, result FROM url_scans WHERE url = 'cycle:' || :client_id || ':' || :k;
INSERT INTO url_scans (url, status) VALUES ('cycle:' || :client_id || ':' || :k, 'in_progress')
    ON CONFLICT (url) DO NOTHING RETURNING url;
UPDATE url_scans SET status = 'completed', result = '{"title": "page"}', updated_at = now()
    WHERE url = 'cycle:' || :client_id || ':' || :k;
