-- The round-trip limit: a query that does no work.
SELECT 1;
