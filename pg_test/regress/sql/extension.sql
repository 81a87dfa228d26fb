-- The extension as psql's \dx lists it. PostgreSQL 18's psql adds a "Default version"
-- column: expected/extension_1.out is that version's listing.
CREATE EXTENSION pg_once;
\dx pg_once
DROP EXTENSION pg_once;
