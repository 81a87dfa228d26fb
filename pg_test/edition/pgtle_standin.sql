-- A stand-in for pg_tle (run as a superuser by scripts/test-sql-edition-more.sh): schema
-- pgtle with the functions pg_once_tle.sql calls, which check their arguments as pg_tle
-- documents and does (src/tleextension.c), then hand the script to PostgreSQL's own
-- CREATE EXTENSION, as a control file and script file in this private installation's
-- SHAREDIR/extension. pg_tle keeps them as functions of schema pgtle and runs them
-- through a copy of the same extension code; what that changes is in the test's header.
-- The test's PostgreSQL is a private copy (SHAREDIR writable by the server), never a
-- shared installation.
CREATE ROLE pgtle_admin NOLOGIN;
CREATE SCHEMA pgtle;
GRANT USAGE ON SCHEMA pgtle TO PUBLIC;

-- What pg_tle keeps: one row per install script (fromvers NULL) or update script, and
-- the control of each extension.
CREATE TABLE pgtle.standin_scripts (
    name     text NOT NULL,
    fromvers text,
    version  text NOT NULL,
    ext      text NOT NULL,
    UNIQUE NULLS NOT DISTINCT (name, fromvers, version)
);
CREATE TABLE pgtle.standin_controls (
    name            text PRIMARY KEY,
    description     text NOT NULL,
    default_version text NOT NULL,
    requires        text[]
);

-- check_valid_extension_name / check_valid_version_name (PostgreSQL's, which pg_tle
-- copies): not empty, no "--", no leading or trailing "-", no directory separator.
CREATE FUNCTION pgtle.standin_check_name(value text, what text) RETURNS void
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF value IS NULL OR value = '' THEN
        RAISE EXCEPTION 'invalid extension %: "%"', what, value USING ERRCODE = 'invalid_parameter_value',
            DETAIL = format('%s must not be empty.', initcap(what));
    ELSIF strpos(value, '--') > 0 THEN
        RAISE EXCEPTION 'invalid extension %: "%"', what, value USING ERRCODE = 'invalid_parameter_value',
            DETAIL = format('%s must not contain "--".', initcap(what));
    ELSIF left(value, 1) = '-' OR right(value, 1) = '-' THEN
        RAISE EXCEPTION 'invalid extension %: "%"', what, value USING ERRCODE = 'invalid_parameter_value',
            DETAIL = format('%s must not begin or end with "-".', initcap(what));
    ELSIF value ~ '[/\\]' THEN
        RAISE EXCEPTION 'invalid extension %: "%"', what, value USING ERRCODE = 'invalid_parameter_value',
            DETAIL = format('%s must not contain directory separator characters.', initcap(what));
    END IF;
END
$$;

-- validate_tle_sql: pg_tle wraps the script in these dollar quotes (a function body) and
-- refuses one that contains them.
CREATE FUNCTION pgtle.standin_check_sql(ext text) RETURNS void
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF ext IS NULL THEN
        RAISE EXCEPTION 'ext must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF strpos(ext, '$_pgtle_o_$') > 0 OR strpos(ext, '$_pgtle_i_$') > 0 THEN
        RAISE EXCEPTION 'invalid character in extension definition'
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = 'Use of string delimiters "$_pgtle_o_$" and "$_pgtle_i_$" are forbidden in extension definitions.';
    END IF;
END
$$;

-- Writes the control file and every script of `name` where CREATE EXTENSION reads them,
-- byte for byte (lo_export, as the server's user). The control is pg_tle's: superuser,
-- trusted and relocatable forced false, no schema (the 5-argument install_extension).
CREATE FUNCTION pgtle.standin_write(name text) RETURNS void
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    dir text := (SELECT setting FROM pg_config WHERE pg_config.name = 'SHAREDIR') || '/extension/';
    c pgtle.standin_controls;
    s record;
    control text;
    l oid;
BEGIN
    SELECT * INTO c FROM pgtle.standin_controls WHERE standin_controls.name = standin_write.name;
    control := format(E'comment = %L\ndefault_version = %L\nsuperuser = false\ntrusted = false\nrelocatable = false\n',
                      c.description, c.default_version);
    IF cardinality(c.requires) > 0 THEN
        control := control || format(E'requires = %L\n', array_to_string(c.requires, ', '));
    END IF;
    l := lo_from_bytea(0, convert_to(control, 'UTF8'));
    PERFORM lo_export(l, dir || name || '.control');
    PERFORM lo_unlink(l);
    FOR s IN SELECT * FROM pgtle.standin_scripts WHERE standin_scripts.name = standin_write.name LOOP
        l := lo_from_bytea(0, convert_to(s.ext, 'UTF8'));
        PERFORM lo_export(l, dir || name || '--' || coalesce(s.fromvers || '--', '') || s.version || '.sql');
        PERFORM lo_unlink(l);
    END LOOP;
END
$$;

CREATE FUNCTION pgtle.install_extension(name text, version text, description text, ext text,
                                        requires text[] DEFAULT NULL)
    RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pgtle.standin_check_name(name, 'name');
    PERFORM pgtle.standin_check_name(version, 'version');
    PERFORM pgtle.standin_check_sql(ext);
    IF description IS NULL THEN
        RAISE EXCEPTION 'description must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- pg_tle: a TLE never shadows an extension of the file system, nor is installed twice.
    IF EXISTS (SELECT 1 FROM pgtle.standin_controls c WHERE c.name = install_extension.name) THEN
        RAISE EXCEPTION 'extension "%" already installed', name USING ERRCODE = 'duplicate_object';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_available_extensions a WHERE a.name = install_extension.name) THEN
        RAISE EXCEPTION 'control file already exists for the % extension', name USING ERRCODE = 'raise_exception';
    END IF;
    INSERT INTO pgtle.standin_controls VALUES (name, description, version, requires);
    INSERT INTO pgtle.standin_scripts VALUES (name, NULL, version, ext);
    PERFORM pgtle.standin_write(name);
    RETURN true;
END
$$;

CREATE FUNCTION pgtle.install_extension_version_sql(name text, version text, ext text)
    RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pgtle.standin_check_name(version, 'version');
    PERFORM pgtle.standin_check_sql(ext);
    IF NOT EXISTS (SELECT 1 FROM pgtle.standin_controls c WHERE c.name = install_extension_version_sql.name) THEN
        RAISE EXCEPTION 'extension "%" does not exist', name USING ERRCODE = 'undefined_object';
    END IF;
    INSERT INTO pgtle.standin_scripts VALUES (name, NULL, version, ext);
    PERFORM pgtle.standin_write(name);
    RETURN true;
END
$$;

CREATE FUNCTION pgtle.install_update_path(name text, fromvers text, tovers text, ext text)
    RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pgtle.standin_check_name(fromvers, 'version');
    PERFORM pgtle.standin_check_name(tovers, 'version');
    PERFORM pgtle.standin_check_sql(ext);
    IF NOT EXISTS (SELECT 1 FROM pgtle.standin_controls c WHERE c.name = install_update_path.name) THEN
        RAISE EXCEPTION 'extension "%" does not exist', name USING ERRCODE = 'undefined_object';
    END IF;
    IF EXISTS (SELECT 1 FROM pgtle.standin_scripts s WHERE s.name = install_update_path.name
                  AND s.fromvers = install_update_path.fromvers AND s.version = tovers) THEN
        RAISE EXCEPTION 'update path "%" to "%" of extension "%" already installed', fromvers, tovers, name
            USING ERRCODE = 'duplicate_object';
    END IF;
    INSERT INTO pgtle.standin_scripts VALUES (name, fromvers, tovers, ext);
    PERFORM pgtle.standin_write(name);
    RETURN true;
END
$$;

CREATE FUNCTION pgtle.set_default_version(name text, version text)
    RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pgtle.standin_scripts s WHERE s.name = set_default_version.name
                      AND s.version = set_default_version.version AND s.fromvers IS NULL) THEN
        RAISE EXCEPTION 'version "%" of extension "%" is not installed', version, name
            USING ERRCODE = 'undefined_object';
    END IF;
    UPDATE pgtle.standin_controls c SET default_version = version WHERE c.name = set_default_version.name;
    PERFORM pgtle.standin_write(name);
    RETURN true;
END
$$;

-- The TLEs of this stand-in, as pg_tle lists its own.
CREATE FUNCTION pgtle.available_extension_versions()
    RETURNS TABLE (name name, version text, superuser boolean, trusted boolean, relocatable boolean,
                   schema name, requires name[], comment text)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.name::name, s.version, false, false, false, NULL::name, c.requires::name[], c.description
      FROM pgtle.standin_scripts s JOIN pgtle.standin_controls c USING (name)
     WHERE s.fromvers IS NULL
$$;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgtle FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgtle.install_extension(text, text, text, text, text[]),
                          pgtle.install_extension_version_sql(text, text, text),
                          pgtle.install_update_path(text, text, text, text),
                          pgtle.set_default_version(text, text)
    TO pgtle_admin;
GRANT EXECUTE ON FUNCTION pgtle.available_extension_versions() TO PUBLIC;
