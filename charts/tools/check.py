"""Lints, renders and validates the calix chart for a list of value sets: Helm's own library
(helm-python-sdk: Helm v4's Go SDK, no helm binary) and kubernetes-validate (the Kubernetes
JSON schemas), plus the chart's CRDs for its own kinds.

    python check.py <chart dir> <cases.json> <kubernetes version, e.g. 1.36.0>

cases.json is a list of {"name": ..., "values": {...}}. The output (stdout) is one JSON
object: {"defaults": the chart's values.yaml, "results": [a result per case]}, each result

    {"name", "lint": [{"severity", "path", "error"}], "schema_error": str | null,
     "render_error": str | null, "objects": [{"template", "object"}],
     "problems": [str], "unchecked": [str]}

`problems` are objects that fail their schema (or have none, for a built-in kind);
`unchecked` are custom kinds the chart ships no CRD for. The caller decides what passes:
this script only reports (tests/tests/chart.rs).
"""

import json
import sys

import helm_python as helm
import kubernetes_validate
import yaml

SEVERITY = {0: "unknown", 1: "info", 2: "warning", 3: "error"}
RELEASE = "calix"
NAMESPACE = "kube-system"


def crd_schemas(chart):
    """(group, version, kind) -> openAPIV3Schema of every CRD under crds/."""
    schemas = {}
    for crd in chart.crds:
        for doc in yaml.safe_load_all(crd["data"]):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec.get("versions", []):
                schema = version.get("schema", {}).get("openAPIV3Schema")
                key = (spec["group"], version["name"], spec["names"]["kind"])
                schemas[key] = schema
    return schemas


def crd_objects(chart):
    objects = []
    for crd in chart.crds:
        for doc in yaml.safe_load_all(crd["data"]):
            if doc:
                objects.append({"template": crd["filename"], "object": doc})
    return objects


def validate(obj, kube_version, schemas):
    """([problems], [unchecked]) for one object."""
    name = "%s/%s" % (obj.get("kind"), (obj.get("metadata") or {}).get("name"))
    api_version = obj.get("apiVersion", "")
    group, _, version = api_version.rpartition("/")
    key = (group, version, obj.get("kind"))
    if key in schemas:
        import jsonschema

        validator = jsonschema.Draft202012Validator(schemas[key] or {})
        errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
        return (
            ["%s: %s: %s" % (name, ".".join(map(str, e.path)), e.message) for e in errors],
            [],
        )
    if group.endswith("calix.dev"):
        return [], ["%s (%s): no CRD in the chart" % (name, api_version)]
    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
        return [], []
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return ["%s: %s: %s" % (name, path, e.message)], []
    except kubernetes_validate.SchemaNotFoundError as e:
        return ["%s: %s" % (name, e.message)], []


def run_case(chart_dir, chart, case, kube_version, schemas):
    values = case["values"]
    result = {
        "name": case["name"],
        "lint": [],
        "schema_error": None,
        "render_error": None,
        "objects": [],
        "problems": [],
        "unchecked": [],
    }
    report = helm.lint(chart_dir, values, strict=True, namespace=NAMESPACE,
                       kube_version="v" + kube_version)
    result["lint"] = [
        {"severity": SEVERITY.get(m["severity"], str(m["severity"])),
         "path": m["path"], "error": m["error"]}
        for m in report["messages"]
    ]
    try:
        chart.validate_schema(values)
    except helm.HelmError as e:
        result["schema_error"] = str(e)
    try:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as e:
        result["render_error"] = str(e)
        return result
    objects = crd_objects(chart)
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            objects.append({"template": template, "object": {"notes": text}})
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append({"template": template, "object": doc})
    result["objects"] = objects
    for item in objects:
        obj = item["object"]
        if "notes" in obj:
            continue
        problems, unchecked = validate(obj, kube_version, schemas)
        result["problems"] += ["%s: %s" % (item["template"], p) for p in problems]
        result["unchecked"] += unchecked
    return result


def main():
    chart_dir, cases_file, kube_version = sys.argv[1:4]
    with open(cases_file) as f:
        cases = json.load(f)
    results = []
    with helm.Chart.load(chart_dir) as chart:
        schemas = crd_schemas(chart)
        for case in cases:
            results.append(run_case(chart_dir, chart, case, kube_version, schemas))
        defaults = chart.values
    json.dump({"defaults": defaults, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
