-- One key: the jitter's draw and the time come as parameters ($draw, $now), read just
-- before the statement, rather than from a row source `FROM (SELECT random() AS draw,
-- clock_timestamp() AS now) d` as complete_keys has them for each of its keys: that join
-- made every complete_key plan a nested loop over a subquery, whose executor start alone
-- was 4% of a claim+complete cycle's server time (perf, issue 25).
UPDATE once.entries AS e SET {{completed(result=$result; d=$)}}
      WHERE key_hash = $key_hash AND token = $token AND state = 'running' AND {{token_holder(alias=)}}
     RETURNING {{ended_attempt_columns}}
