#!/usr/bin/env python3
"""Check a PGXN distribution made by `scripts/package.sh --pgxn`:

    check-meta.py pg_once-VERSION.zip VERSION

- everything sits under pg_once-VERSION/, and META.json is there;
- META.json has what PGXN Meta Spec 1.0.0 requires (name, abstract, maintainer,
  license, provides with a file and version each, meta-spec 1.0.0, a semantic version),
  and its versions are VERSION, Cargo.toml's;
- the files it names are in the distribution.
"""

import json
import re
import sys
import zipfile

path, version = sys.argv[1:3]
prefix = f"pg_once-{version}/"
failures = []


def check(ok, message):
    if not ok:
        failures.append(message)


names = zipfile.ZipFile(path).namelist()
check(all(n.startswith(prefix) for n in names), f"not everything is under {prefix}")
if prefix + "META.json" not in names:
    sys.exit(f"check-meta: {path} has no {prefix}META.json")
meta = json.loads(zipfile.ZipFile(path).read(prefix + "META.json"))

semver = r"\d+\.\d+\.\d+(-[0-9A-Za-z-]+)?"
for field in ["name", "abstract", "maintainer", "license", "provides", "meta-spec", "version"]:
    check(field in meta, f"META.json has no {field}")
check(meta.get("name") == "pg_once", "name is not pg_once")
check(meta.get("version") == version, f"version {meta.get('version')}, Cargo.toml says {version}")
check(re.fullmatch(semver, version or ""), f"{version} is not a semantic version")
check(meta.get("meta-spec", {}).get("version") == "1.0.0", "meta-spec version is not 1.0.0")
check(meta.get("license") == "postgresql", "license is not postgresql (Cargo.toml: PostgreSQL)")
for ext, spec in meta.get("provides", {}).items():
    check(spec.get("version") == version, f"provides.{ext}.version is not {version}")
    for key in ["file", "docfile"]:
        if key in spec:
            check(prefix + spec[key] in names, f"provides.{ext}.{key} {spec[key]} is not in the zip")
    check("file" in spec, f"provides.{ext} has no file")
check("pg_once" in meta.get("provides", {}), "META.json does not provide pg_once")

for f in failures:
    print("check-meta:", f)
if failures:
    sys.exit(1)
print(f"check-meta: {path}: META.json {version}, {len(names)} files")
