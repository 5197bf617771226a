"""Renders a Helm chart offline with Helm's own engine (PyPI `helm-python-sdk`, Helm v4's Go
SDK behind ctypes; `cargo xtask test` installs it into .venv), as `helm template` would.

    render.py CHART NAMESPACE [--values FILE]... [--json VALUES] [--lint]

Values files and the --json object are merged in order (later wins, maps merged deeply), then
checked against the chart's values.schema.json when it has one, then rendered. Prints every
manifest as one YAML stream (NOTES.txt rendered but left out), template by template (Helm
installs by kind; the tests compare objects, not order). With --lint, prints `helm lint
--strict`'s findings as JSON instead. Helm's errors go to stderr with exit status 1.
"""

import json
import sys

import helm_python as helm


def merge(into, new):
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


def main(argv):
    helm.disable_logging()
    chart_dir, namespace, rest = argv[0], argv[1], argv[2:]
    values, lint = {}, False
    i = 0
    while i < len(rest):
        if rest[i] == "--values":
            with open(rest[i + 1]) as f:
                # YAML -> dict through Helm's own parser.
                merge(values, helm.values_from_yaml(f.read()))
            i += 2
        elif rest[i] == "--json":
            merge(values, json.loads(rest[i + 1]))
            i += 2
        elif rest[i] == "--lint":
            lint = True
            i += 1
        else:
            raise SystemExit(f"unknown argument {rest[i]}")
    if lint:
        print(json.dumps(helm.lint(chart_dir, values, strict=True, namespace=namespace)))
        return
    with helm.Chart.load(chart_dir) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name="kvmesh", namespace=namespace, is_install=True)
    for path in sorted(out):
        if path.endswith("NOTES.txt"):
            continue
        print(f"---\n# Source: {path}\n{out[path]}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except helm.HelmError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
