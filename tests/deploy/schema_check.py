"""check-jsonschema (the CLI of the dev extra) run in the test process: `check(schema_file, instance_files)`.

    from deploy.schema_check import check
    rc, output = check("tests/deploy/schemas/k8s-v1.30.0-job.json", ["job.json"])

The same command line as `check-jsonschema --schemafile SCHEMA FILE...`, invoked through its click entry point
so that the suite pays for importing it once rather than once per schema.
"""
from __future__ import annotations


def check(schema: str, instances: list[str]) -> tuple[int, str]:
    from check_jsonschema.cli.main_command import main
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["--schemafile", str(schema), *map(str, instances)])
    return result.exit_code, result.output
