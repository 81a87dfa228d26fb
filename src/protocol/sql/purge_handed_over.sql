DELETE FROM once.entries
      WHERE left(key, length($prefix)) = $prefix
        AND (length(coalesce(once_internal.key_namespace(key), '')) < length($prefix) OR $owner_changes)
